"""A run killed (SIGKILL) in the middle of a checkpoint save leaves no process behind: not megatron's file
writers (forked per file), not a results-queue Manager server, not multiprocessing's resource tracker.

The save runs in a child process whose writer is held inside its file write (it announces itself, then
waits); the child is SIGKILLed there, and every process of its session must be gone shortly after."""
import os
import signal
import subprocess
import time
from pathlib import Path

from mcore_harness import PYTHON, ROOT

SAVER = r'''
import sys
import time
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync


def held_write(*args, **kwargs):  # runs in megatron's forked writer process
    Path(sys.argv[3]).write_text("writing")
    time.sleep(300)  # killed long before


FileSystemWriterAsync.write_preloaded_data = staticmethod(held_write)


def main():
    from sparse_rl_megatron.learner import Learner, LearnerConfig

    lrn = Learner(LearnerConfig(model_path=sys.argv[1], params_dtype="float32", layer_spec="local"), trainable=False)
    lrn.save(sys.argv[2])


if __name__ == "__main__":
    main()
'''

# After the kill, the session's processes need a moment to notice and exit; anything left after this is an orphan.
EXIT_GRACE_S = 15


def _session(sid: int) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process whose session id is ``sid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != sid or (entry / "stat").read_text().split(")")[-1].split()[0] == "Z":
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except (OSError, ProcessLookupError):
            continue
    return found


def test_sigkill_mid_save_leaves_no_process(mcore_refs, tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    marker = tmp_path / "writer_started"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    log = open(tmp_path / "saver.log", "w")
    proc = subprocess.Popen([PYTHON, str(script), str(mcore_refs.parent / "llama"), str(tmp_path / "ckpt"),
                             str(marker)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    survivors: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, f"the saver exited early:\n{(tmp_path / 'saver.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the save never reached megatron's file writer"
            time.sleep(0.2)
        assert len(_session(proc.pid)) >= 2  # the saver and its writer, at least
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + EXIT_GRACE_S
        while (survivors := _session(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for pid in _session(proc.pid):  # what this test started and is still there
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    assert not survivors, f"processes left behind by the killed save: {survivors}"
