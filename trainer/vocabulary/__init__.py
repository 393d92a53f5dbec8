"""The vocabulary: what every package of the house may import of ``trainer`` (DESIGN 2).

Deadlines, the stage/operation context that names a hang, cleanup with the remaining
budget, the owner nursery, waits on Ray refs, the names of stages and operations, and fault
injection. It imports nothing of ours but :mod:`trainer.errors`; ``engines``, ``sync`` and
the workers import this module (never its private submodules, never the rest of
``trainer``). The contracts in ``.importlinter`` check it.

Rules it implements (DESIGN 3): deadlines are cancel scopes (:func:`step_deadline`); stage
and operation are context (:func:`stage`, :func:`operation`, :class:`Timer`); waits on
remote work use the remaining budget (:func:`remaining`, :func:`wait_result`,
:func:`wait_refs`); cleanup gets what is left (:func:`cleanup_bracket`); every task has an
owner nursery (:func:`open_owner_nursery`); work given up past its own bound (a rollout)
says where it was (:func:`bounded`). A debugger reads where another task is with
:func:`place_of`.
"""

from trainer.vocabulary._cleanup import cleanup_bracket as cleanup_bracket
from trainer.vocabulary._cleanup import cleanup_preserving_primary as cleanup_preserving_primary
from trainer.vocabulary._context import AWAIT as AWAIT
from trainer.vocabulary._context import Timer as Timer
from trainer.vocabulary._context import at_step as at_step
from trainer.vocabulary._context import current_operation as current_operation
from trainer.vocabulary._context import current_stage as current_stage
from trainer.vocabulary._context import current_step as current_step
from trainer.vocabulary._context import operation as operation
from trainer.vocabulary._context import stage as stage
from trainer.vocabulary._deadlines import Bound as Bound
from trainer.vocabulary._deadlines import bounded as bounded
from trainer.vocabulary._deadlines import current_deadline as current_deadline
from trainer.vocabulary._deadlines import pending_deadline_error as pending_deadline_error
from trainer.vocabulary._deadlines import remaining as remaining
from trainer.vocabulary._deadlines import step_deadline as step_deadline
from trainer.vocabulary._deadlines import wait_result as wait_result
from trainer.vocabulary._fault_spec import SKEW_OPS as SKEW_OPS
from trainer.vocabulary._fault_spec import Action as FaultAction
from trainer.vocabulary._fault_spec import Fault as Fault
from trainer.vocabulary._fault_spec import Faults as Faults
from trainer.vocabulary._fault_spec import parse_faults as parse_faults
from trainer.vocabulary._faults import FAULTS_ENV as FAULTS_ENV
from trainer.vocabulary._faults import FAULTS_FIRED_ENV as FAULTS_FIRED_ENV
from trainer.vocabulary._faults import active_faults as active_faults
from trainer.vocabulary._faults import fire_fault as fire_fault
from trainer.vocabulary._faults import fire_fault_sync as fire_fault_sync
from trainer.vocabulary._faults import install_faults as install_faults
from trainer.vocabulary._faults import release_hangs as release_hangs
from trainer.vocabulary._faults import sampler_skew as sampler_skew
from trainer.vocabulary._faults import set_engine_signaller as set_engine_signaller
from trainer.vocabulary._faults import unfired_faults as unfired_faults
from trainer.vocabulary._names import OPERATIONS as OPERATIONS
from trainer.vocabulary._names import STAGES as STAGES
from trainer.vocabulary._names import Operation as Operation
from trainer.vocabulary._names import Stage as Stage
from trainer.vocabulary._nursery import leaves as exception_leaves
from trainer.vocabulary._nursery import open_owner_nursery as open_owner_nursery
from trainer.vocabulary._nursery import raise_first as raise_first
from trainer.vocabulary._places import Place as Place
from trainer.vocabulary._places import place_of as place_of
from trainer.vocabulary._ray_waits import get_refs_as_completed as get_refs_as_completed
from trainer.vocabulary._ray_waits import wait_refs as wait_refs

__all__ = [
    "AWAIT",
    "FAULTS_ENV",
    "FAULTS_FIRED_ENV",
    "OPERATIONS",
    "SKEW_OPS",
    "STAGES",
    "Bound",
    "Fault",
    "FaultAction",
    "Faults",
    "Operation",
    "Place",
    "Stage",
    "Timer",
    "active_faults",
    "at_step",
    "bounded",
    "cleanup_bracket",
    "cleanup_preserving_primary",
    "current_deadline",
    "current_operation",
    "current_stage",
    "current_step",
    "exception_leaves",
    "fire_fault",
    "fire_fault_sync",
    "install_faults",
    "open_owner_nursery",
    "operation",
    "parse_faults",
    "pending_deadline_error",
    "place_of",
    "raise_first",
    "release_hangs",
    "remaining",
    "sampler_skew",
    "set_engine_signaller",
    "stage",
    "step_deadline",
    "unfired_faults",
    "wait_refs",
    "wait_result",
]
