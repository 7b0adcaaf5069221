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

QUICK = ["data.digits=1", "data.num_train=40", "data.num_eval=10", "eval.num_prompts=6", "eval.every_steps=0",
         "sft.enabled=false", "sft.eval_prompts=6", "sft.global_batch_size=32", "sft.micro_batch_size=16",
         "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "algorithm.filter_uniform_groups=false", "rollout.num_servers=1",
         "reward.num_workers=1", "train.save_every=1", "resume=auto"]


def two_nodes(run_dir: Path, base: int, *overrides: str, timeout: float = 240) -> str:
    """Both agents of a 2-node job (node 0 hosts the c10d rendezvous store); returns their joined output
    after checking that both exited 0."""
    rdzv = free_port_block(1)
    procs = []
    for host in ("true", "false"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--rdzv-id", f"moerl{rdzv}",
               "--rdzv-conf", f"is_host={host}", "-m", "moerl.cli", "train", RECIPE, f"output_dir={run_dir}",
               f"rollout.base_port={base}", f"rollout.router_port={base + 2}", *QUICK, *overrides]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                                      cwd=REPO))
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
