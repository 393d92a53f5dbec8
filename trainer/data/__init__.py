"""The prompts and their rewards: examples and their loader, the built-in tasks and data files
(:func:`load_datasets`), reward functions (``data.reward_fn=module:function``) and where
they run, bounded (:func:`open_rewards`: the loop, worker processes, async)."""

from trainer.data._datasets import load_datasets as load_datasets
from trainer.data._examples import ChatMessage as ChatMessage
from trainer.data._examples import Example as Example
from trainer.data._examples import PromptLoader as PromptLoader
from trainer.data._examples import RewardFn as RewardFn
from trainer.data._examples import RewardFunction as RewardFunction
from trainer.data._examples import check_same_order as check_same_order
from trainer.data._examples import check_same_strategy as check_same_strategy
from trainer.data._examples import digit_task_reward as digit_task_reward
from trainer.data._examples import epoch_order as epoch_order
from trainer.data._examples import exact_match_reward as exact_match_reward
from trainer.data._examples import reward_function as reward_function
from trainer.data._reward_runner import RewardTally as RewardTally
from trainer.data._reward_runner import count_reward_failures as count_reward_failures
from trainer.data._reward_runner import open_rewards as open_rewards

__all__ = [
    "ChatMessage",
    "Example",
    "PromptLoader",
    "RewardFn",
    "RewardFunction",
    "RewardTally",
    "check_same_order",
    "check_same_strategy",
    "count_reward_failures",
    "digit_task_reward",
    "epoch_order",
    "exact_match_reward",
    "load_datasets",
    "open_rewards",
    "reward_function",
]
