"""A torchrun job that is stopped from outside leaves no process behind; the same job (2 trainer ranks,
dp_size 2) syncs its weights with rollout.weight_sync=distributed, which hung before the fix in
DistributedWeightUpdater.init_group (tests/test_torchrun_weight_sync.py has the fast check).

torchrun's agent forwards SIGTERM to its workers; rank 0 stops its rollout servers, router and reward
workers (RolloutCluster's SIGTERM handler, the reward pool's death signal). When the agent itself is
SIGKILLed nothing is forwarded: the workers then get SIGTERM from the kernel
(``prctl(PR_SET_PDEATHSIG)``, set by moerl.runtime.distributed.init_distributed under torchrun), and
the servers / router / reward workers get SIGKILL when rank 0 dies (moerl.runtime.procs).

Reference: the process tree (psutil) taken while the job runs, every process of which must be gone a
few seconds after the signal.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_torchrun_main_job import RECIPE, REPO, _env, _ports  # noqa: E402

from _mp_helpers import free_port_block  # noqa: E402

# RL from a random model (sft off), small batches, one server and one reward worker: the quickest job that
# runs every part (also tests/test_two_node.py's)
QUICK = ["data.digits=1", "data.num_train=40", "data.num_eval=10", "eval.num_prompts=6", "eval.every_steps=0",
         "sft.enabled=false", "sft.eval_prompts=6", "sft.global_batch_size=32", "sft.micro_batch_size=16",
         "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=8", "algorithm.filter_uniform_groups=false", "rollout.num_servers=1",
         "reward.num_workers=1"]
LONG = [*QUICK, "train.num_steps=10000", "rollout.weight_sync=distributed"]


@pytest.mark.parametrize("sig", [
    pytest.param(signal.SIGKILL, marks=pytest.mark.slow),
    # forwarded by the agent to the workers (RolloutCluster's handler stops the servers): passed before
    # the death-signal fix too; not in CI's slow budget, run it with -m demo
    pytest.param(signal.SIGTERM, marks=pytest.mark.demo)], ids=["sigkill", "sigterm"])
def test_stopping_the_agent_stops_every_descendant(tmp_path, sig):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port_block(1)), "-m", "moerl.cli", "train", RECIPE, *_ports(tmp_path / "run"),
           *LONG]
    log = open(tmp_path / "out.log", "w+")
    agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    tree: list = []
    try:
        deadline = time.monotonic() + 120
        while "step 2/" not in (tmp_path / "out.log").read_text():  # 2 distributed syncs done, all up
            assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "out.log").read_text()[-3000:]
            time.sleep(0.2)
        # the broadcast weights are the trainer's: server log-probs match Megatron's before the first update
        assert re.search(r"STEP-0 CHECK: .*?: PASS; .*?: PASS", (tmp_path / "out.log").read_text())
        tree = psutil.Process(agent.pid).children(recursive=True)
        names = [" ".join(p.cmdline()[:4]) for p in tree]
        assert len(tree) >= 2 + 1 + 1 + 1, names  # 2 ranks, a server, the router, a reward worker
        assert any("moerl.rollout.server" in n for n in names) and any("_worker" in n for n in names), names
        t0 = time.monotonic()
        os.kill(agent.pid, sig)
        agent.wait(timeout=60)
        gone, alive = psutil.wait_procs(tree, timeout=15)
        print(f"{sig.name}: {len(tree)} descendants gone {time.monotonic() - t0:.1f} s after the signal")
        assert not alive, [" ".join(p.cmdline()[:4]) for p in alive]
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        for p in tree:  # what a failing run leaves behind
            try:
                p.kill()
            except psutil.Error:
                pass
        log.close()
