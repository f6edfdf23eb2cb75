"""Prefect retries happen for transient failures only; deterministic errors fail at once."""

from __future__ import annotations

import pytest

from llmpipe.config import ConfigError
from llmpipe.stages import StageError, is_transient


def test_is_transient():
    assert is_transient(StageError("rank killed", transient=True))
    assert not is_transient(StageError("bad data"))
    assert not is_transient(ConfigError("train.max_steps: bad"))
    assert is_transient(ConnectionResetError())
    assert not is_transient(ValueError("bug"))


@pytest.mark.parametrize("exc,expected_calls", [
    (StageError("a rank was killed", transient=True), 3),
    (StageError("data.inputs[0]: matched no files"), 1),
    (ConfigError("train.max_steps: must be >= 1"), 1),
])
def test_retry_only_transient(exc, expected_calls):
    from prefect import flow

    from tasks.stages import _task

    calls = []

    @_task("flaky")
    def flaky() -> None:
        calls.append(1)
        raise exc

    @flow(name="retry-probe")
    def probe() -> None:
        flaky.with_options(retries=2, retry_delay_seconds=0)()

    with pytest.raises(type(exc)):
        probe()
    assert len(calls) == expected_calls
