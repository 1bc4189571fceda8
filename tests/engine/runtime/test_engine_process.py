"""The executor clients: `ExecutorProcess` (spawn, execute, health, crash detection, restart,
shutdown) and `InProcessExecutor`, one surface (`ExecutorClient`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.core.engine_args import ENGINE_NICE, EngineArgs
from engine.core.model_files import DEMO_MODEL
from engine.core.protocol import SeqChunk, StepPlan
from engine.loading.demo import demo_model_dir
from engine.runtime.engine_process import ExecutorProcess
from engine.runtime.executor_client import (
    ExecutorClient,
    ExecutorDiedError,
    ExecutorStartError,
    InProcessExecutor,
)
from policy import Policy
from tests.engine.runtime.threads import thread_nice

FACTORY = "tests.engine.runtime.toy_executor:build_executor"


def plan(step_id: int) -> StepPlan:
    chunk = SeqChunk(
        seq_id=7,
        token_ids=[5, 9],
        start_pos=0,
        gpu_batch=0,
        new_pages=[("gpu", 0)],
        kv_tier="gpu",
        act_tier="gpu",
        do_sample=True,
    )
    return StepPlan(step_id=step_id, chunks=[chunk])


def test_child_process_lifecycle() -> None:
    executor = ExecutorProcess(FACTORY, start_timeout_s=60)
    executor.start()
    try:
        assert executor.describe().placement.device == "toy"  # the child's own report
        assert "tests.engine.runtime.toy_executor" not in sys.modules, (
            "the parent must not import the factory"
        )
        result = executor.execute(plan(3))
        assert (result.step_id, result.seq_ids, result.token_ids) == (3, [7], [10])
        assert executor.health()
        assert executor._process is not None and executor._process.pid
        os.kill(executor._process.pid, signal.SIGKILL)
        with pytest.raises(ExecutorDiedError):
            executor.execute(plan(4))
        assert not executor.health()
        executor.restart()
        assert executor.execute(plan(5)).token_ids == [10]
    finally:
        executor.shutdown(timeout_s=10)
    assert not executor.is_alive


@pytest.mark.parametrize(
    ("factory", "nice", "expected"),
    [
        ("build_executor", 0, 0),  # the default: as the parent
        ("build_executor", 7, 7),
        ("build_executor", None, 0),  # auto: not a CPU engine
        ("build_cpu_executor", None, ENGINE_NICE),  # auto: a CPU engine yields to the daemon
        ("build_cpu_executor", 0, 0),  # the off switch
    ],
)
def test_the_engine_process_runs_below_the_daemon(
    factory: str, nice: int | None, expected: int
) -> None:
    """Once built, the child lowers every thread's CPU priority by `nice`; the parent keeps
    its own (tests/server/test_durability.py checks a real CPU engine's threads, the ones
    started after the build included)."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    executor = ExecutorProcess(f"tests.engine.runtime.toy_executor:{factory}", nice=nice)
    executor.start()
    try:
        assert executor._process is not None and executor._process.pid
        child = executor._process.pid
        assert executor.execute(plan(1)).token_ids == [10]
        threads = thread_nice(child)
        assert len(threads) >= 2  # the main thread and the parent watch, at least
        assert set(threads.values()) == {own + expected}, threads
        assert set(thread_nice(os.getpid()).values()) == {own}
    finally:
        executor.shutdown(timeout_s=10)


def test_start_failure_reports_child_traceback() -> None:
    executor = ExecutorProcess(FACTORY, {"fail": True}, start_timeout_s=60)
    with pytest.raises(ExecutorStartError, match="toy executor asked to fail"):
        executor.start()
    assert not executor.is_alive


def test_in_process_executor_has_same_surface() -> None:
    executor = InProcessExecutor(FACTORY)
    assert isinstance(executor, ExecutorClient) and issubclass(ExecutorProcess, ExecutorClient)
    executor.start()
    assert executor.health() and executor.execute(plan(1)).token_ids == [10]
    executor.shutdown()
    assert not executor.is_alive


REAL_FACTORY = "engine.executor.executor:build_executor"


def demo_kwargs() -> dict[str, object]:
    """The real factory's arguments: the `EngineArgs` record as it is, the model directory
    and the policy (KV on the disk tier, in a scratch directory)."""
    args = EngineArgs(model=DEMO_MODEL, device="cpu")
    return {"args": args, "model_dir": str(demo_model_dir()), "policy": Policy(kv_frac=(0, 0, 1))}


def test_a_killed_engine_leaves_no_scratch_directory() -> None:
    """The executor's temporary disk tier goes with it: removed at shutdown by the child,
    and by the parent when the child was killed and could not."""
    executor = ExecutorProcess(REAL_FACTORY, demo_kwargs(), start_timeout_s=120)
    executor.start()
    scratch = executor.describe().scratch_dir
    assert scratch is not None and os.path.isdir(scratch)
    assert executor._process is not None and executor._process.pid
    os.kill(executor._process.pid, signal.SIGKILL)
    executor.restart()  # kill() cleans up after the dead child, start() makes a new one
    assert not os.path.exists(scratch)
    second = executor.describe().scratch_dir
    assert second is not None and os.path.isdir(second) and second != scratch
    executor.shutdown(timeout_s=30)
    assert not os.path.exists(second)


def test_sigterm_to_a_command_removes_its_scratch_directory(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text('{"kv_frac": [0, 0, 1]}')
    command = [sys.executable, "-m", "server.cli", "generate", "--model", "nanoflex-demo"]
    command += [
        "--prompt",
        "hello",
        "--max-tokens",
        "2000",
        "--device",
        "cpu",
        "--policy",
        str(policy),
    ]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("nanoflex-offload-*/kv-*.bin")):  # generating
            assert process.poll() is None and time.monotonic() < deadline, "never got going"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        process.kill()
    assert not list(tmp_path.glob("nanoflex-offload-*"))


_DAEMON = """
import sys, threading, time
from pathlib import Path
from engine.core.offload_dir import lock_offload_dir
from engine.runtime.engine_process import ExecutorProcess
from tests.engine.runtime.test_engine_process import plan
lock_offload_dir(Path(sys.argv[1]))
executor = ExecutorProcess("tests.engine.runtime.toy_executor:build_slow_executor")
executor.start()
threading.Thread(target=executor.execute, args=(plan(1),), daemon=True).start()
print(executor._process.pid, flush=True)
time.sleep(120)
"""


def test_the_engine_process_holds_the_offload_lock_and_dies_with_its_daemon(
    tmp_path: Path,
) -> None:
    """A stand-in daemon locks an offload directory and starts its engine process, which
    inherits the lock (the same open file); the daemon is killed with -9 while the engine is
    in the middle of a step: the engine exits within a second or two, and the directory is
    free again."""
    import psutil

    from engine.core.offload_dir import LOCK_NAME, OffloadDirError, lock_offload_dir

    daemon = subprocess.Popen(
        [sys.executable, "-c", _DAEMON, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        assert daemon.stdout is not None
        engine = psutil.Process(int(daemon.stdout.readline()))
        lock_file = str(tmp_path / LOCK_NAME)
        assert any(f.path == lock_file for f in engine.open_files()), "lock not inherited"
        with pytest.raises(OffloadDirError, match="in use by another nanoflex process"):
            lock_offload_dir(tmp_path, wait_s=0)
        daemon.kill()
        daemon.wait()
        start = time.monotonic()
        psutil.wait_procs([engine], timeout=10)
        assert not engine.is_running(), "the engine process outlived its daemon"
        assert time.monotonic() - start < 5
        lock_offload_dir(tmp_path, wait_s=5).release()
    finally:
        daemon.kill()
