"""Two nodes on one machine (issue #17): two torchrun agents meeting at a c10d rendezvous on 127.0.0.1
act as two nodes of one job (1 trainer rank each: world size 2, dp_size 2).

Each node's local rank 0 starts its own rollout.num_servers reference servers (node n on
rollout.base_port + n * num_servers ..), the router on node 0 fronts all of them, and every weight sync
must reach every node's servers: each sync ends by checking that EVERY server reports the new
weight_version (moerl.rollout.weight_sync.verify_weight_version raises otherwise), so a run that
finishes has updated node 1's servers too. Checkpoints are written and ``resume=auto`` continues the job
with both agents started again.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _mp_helpers import free_port_block  # noqa: E402
from test_torchrun_main_job import RECIPE, REPO, _env  # noqa: E402
from test_torchrun_signals import QUICK as _QUICK  # noqa: E402

QUICK = [*_QUICK, "train.save_every=1", "resume=auto"]


def start_agents(run_dir: Path, base: int, *overrides: str, stdout=subprocess.PIPE) -> list[subprocess.Popen]:
    """The two torchrun agents of a 2-node job (the first hosts the c10d rendezvous store), started."""
    rdzv = free_port_block(1)
    procs = []
    for host in ("true", "false"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--rdzv-id", f"moerl{rdzv}",
               "--rdzv-conf", f"is_host={host}", "-m", "moerl.cli", "train", RECIPE, f"output_dir={run_dir}",
               f"rollout.base_port={base}", f"rollout.router_port={base + 2}", *QUICK, *overrides]
        procs.append(subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO))
    return procs


def two_nodes(run_dir: Path, base: int, *overrides: str, timeout: float = 240) -> str:
    """Both agents of a 2-node job run to their end; returns their joined output after checking that both
    exited 0."""
    procs = start_agents(run_dir, base, *overrides)
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), out[-6000:]
    return out


@pytest.mark.slow
def test_two_nodes_serve_sync_checkpoint_and_resume(tmp_path):
    run, base = tmp_path / "run", free_port_block(3)
    out = two_nodes(run, base, "train.num_steps=2")
    # the router on node 0 fronts both nodes' servers
    assert re.search(rf"rollout: 2 nodes, 2 servers behind the router on node 0: node 0: \['http://127.0.0.1:{base}'\]; "
                     rf"node 1: \['http://127.0.0.1:{base + 1}'\]", out), out[-4000:]
    assert "trainer: 2 ranks" in out and "step 2/2" in out and "EVAL after RL" in out, out[-4000:]
    assert re.search(r"STEP-0 CHECK: .*?: PASS; .*?: PASS", out), out[-4000:]
    assert (run / "logs" / "node1" / "server_0.log").is_file()  # node 1's own server
    assert (run / "checkpoints" / "step_2" / "moerl_complete.json").is_file()
    # resume=auto: both agents again, one more step
    out2 = two_nodes(run, base, "train.num_steps=3")
    assert f"RESUME from {run / 'checkpoints' / 'step_2'}:" in out2 and "step 3/3" in out2, out2[-4000:]
    assert (run / "checkpoints" / "step_3" / "moerl_complete.json").is_file()


@pytest.mark.demo  # three 2-node runs: over CI's slow budget; run with -m demo
def test_kill9_of_one_nodes_agent_then_resume_is_bit_identical(tmp_path):
    """Node 1's agent is SIGKILLed after step 2 (its worker and servers follow it: PR_SET_PDEATHSIG), node 0's
    job fails on the lost peer; both agents started again with resume=auto finish the job with final
    weights bit-identical to an uninterrupted 2-node run (reference: that run's hf_export)."""
    import os
    import signal
    import time

    import torch
    from safetensors.torch import load_file

    steps = "train.num_steps=4"
    ref = tmp_path / "ref"
    two_nodes(ref, free_port_block(3), steps)
    run, base = tmp_path / "run", free_port_block(3)
    log = tmp_path / "killed.log"
    with open(log, "w") as f:
        procs = start_agents(run, base, steps, stdout=f)
        try:
            deadline = time.monotonic() + 300
            while not (run / "checkpoints" / "step_2" / "moerl_complete.json").is_file():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log.read_text()[-4000:]
                time.sleep(0.2)
            os.kill(procs[1].pid, signal.SIGKILL)
            assert procs[0].wait(timeout=240) != 0  # the job cannot go on without node 1
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert not (run / "hf_export").exists()
    out = two_nodes(run, base, steps)
    assert re.search(rf"RESUME from {run / 'checkpoints'}/step_[23]:", out) and "step 4/4" in out, out[-4000:]
    a, b = load_file(str(ref / "hf_export" / "model.safetensors")), load_file(str(run / "hf_export" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
