"""An ``EngineUnusableError`` comes out of the weight sync quoting the engines' logs."""

from __future__ import annotations

import pytest

from trainer.errors import EngineUnusableError
from trainer.loop._engine_logs import engine_logs_on_unusable, engine_logs_tail


async def test_the_error_quotes_the_end_of_each_engine_log(tmp_path):
    logs = tmp_path / "engines"
    logs.mkdir()
    (logs / "engine-0.log").write_text("x" * 10_000 + "Worker died: SIGSEGV\n")
    (logs / "engine-1.log").write_text("all well\n")
    cause = RuntimeError("update 2 failed")
    with pytest.raises(EngineUnusableError) as info:
        async with engine_logs_on_unusable(tmp_path):
            raise EngineUnusableError(["http://a", "http://b"], "the re-send failed") from cause
    err = info.value
    assert err.urls == ["http://a", "http://b"] and err.__cause__ is cause
    assert "[engine-0.log]" in err.log_tail and "Worker died: SIGSEGV" in err.log_tail
    assert "[engine-1.log]\nall well" in err.log_tail
    assert len(err.log_tail) < 5_000  # the tail, not the whole log
    assert "--- engine log (tail) ---" in str(err)


async def test_without_logs_the_error_is_raised_as_it_was(tmp_path):
    original = EngineUnusableError(["http://a"], "no time was left")
    with pytest.raises(EngineUnusableError) as info:
        async with engine_logs_on_unusable(tmp_path):
            raise original
    assert info.value is original


async def test_a_progress_bar_shows_as_a_terminal_shows_it(tmp_path):
    """Carriage returns (tqdm's) would break the error's last line: only what follows the
    last one on each line is kept."""
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "engine-0.log").write_text(
        "Loading weights:   0%|   | 0/27\rLoading weights: 100%|###| 27/27\nENGINE_READY port=1\n"
    )
    (tmp_path / "engines" / "engine-1.log").write_text("the engine died\n")
    tail = await engine_logs_tail(tmp_path)
    assert "\r" not in tail
    assert tail == (
        "[engine-0.log]\nLoading weights: 100%|###| 27/27\nENGINE_READY port=1\n\n"
        "[engine-1.log]\nthe engine died\n"
    )
    assert await engine_logs_tail(tmp_path / "nowhere") == ""
