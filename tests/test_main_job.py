"""`moerl train` end to end: bad input fails fast with a clear message, a short run prints the
step-0 checks and both evaluations and reproduces itself, a killed rollout server is named, and
Ctrl-C leaves no process behind.

The short runs use the tiny recipe with few steps (the full demo, configs/tiny_arith.yaml, is the
README's main-job command)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _mp_helpers import free_port_block  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "configs" / "tiny_arith.yaml")
FAST = [
    "sft.max_steps=30", "sft.eval_every=15", "sft.eval_prompts=20", "train.num_steps=3",
    "eval.num_prompts=40", "eval.every_steps=2", "rollout.rollout_batch_size=4", "train.global_batch_size=32",
    "train.micro_batch_size=16", "algorithm.filter_uniform_groups=false",  # a 30-step SFT model scores ~0
    "data.num_train=2000", "data.num_eval=100",
    "eval.stop_at_gain=null",  # every step runs (the tiny recipe's +15-point stop needs 6 of 40 eval prompts)
]


def moerl_train(*args: str, timeout: float = 600, env=None, **popen) -> subprocess.CompletedProcess:
    env = env or dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "moerl.cli", "train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO, **popen)


def port_args(tmp_path) -> list[str]:
    base = free_port_block(3)
    return [f"output_dir={tmp_path / 'run'}", "rollout.num_servers=2", f"rollout.base_port={base}",
            f"rollout.router_port={base + 2}"]


# ----------------------------------------------------------------------------- bad input, fast
def test_layout_and_output_dir_checked_before_any_work(tmp_path):
    r = moerl_train(RECIPE, "parallel.tp_size=2", timeout=120)
    assert r.returncode == 2 and "parallel.tp_size" in r.stderr and "Traceback" not in r.stderr
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    r = moerl_train(RECIPE, f"output_dir={a_file}", timeout=120)
    assert r.returncode == 2 and "output_dir" in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    r = moerl_train(str(empty), timeout=120)
    assert r.returncode == 2 and "is empty" in r.stderr


def test_malformed_recipe_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n_samples_per_promt: 8\ntrain:\n  global_batch_size: 100\n")
    r = moerl_train(str(bad), timeout=120)
    assert r.returncode == 2
    assert "rollout.n_samples_per_promt" in r.stderr and "n_samples_per_prompt" in r.stderr  # did-you-mean
    r = moerl_train(RECIPE, "train.micro_batch_size=48", timeout=120)
    assert r.returncode == 2 and "train.global_batch_size" in r.stderr and "micro_batch_size" in r.stderr
    r = moerl_train(RECIPE, "rollout.temperature=hot", timeout=120)
    assert r.returncode == 2 and "rollout.temperature" in r.stderr


def test_distributed_sync_to_remote_servers_needs_a_reachable_rendezvous_address(tmp_path):
    """weight_sync=distributed with a server on another machine and the default rollout.host (loopback):
    refused before any work, naming the field to set."""
    r = moerl_train(RECIPE, f"output_dir={tmp_path / 'run'}", "rollout.weight_sync=distributed",
                    "rollout.external_urls=[http://10.255.0.2:30000]", timeout=120)
    assert r.returncode == 2 and "rollout.weight_sync_master_address" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_router_the_rollout_cannot_run_is_refused_before_compute(tmp_path):
    r = moerl_train(RECIPE, *port_args(tmp_path), "moe.score_function=sigmoid", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "moe.score_function=sigmoid" in r.stderr and "Traceback" not in r.stderr
    assert "sft step" not in r.stdout


def test_missing_dataset_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    r = moerl_train(RECIPE, *port_args(tmp_path), "data.task=jsonl", f"data.train_path={missing}",
                    f"data.eval_path={missing}", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert str(missing) in r.stderr and "data.train_path" in r.stderr
    assert "rollout:" not in r.stdout  # no server was started


def test_row_without_prompt_field(tmp_path):
    rows = [{"prompt": "001+002=", "label": "3"}, {"prompt": "010+020=", "label": "30"},
            {"question": "100+200=", "label": "300"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = moerl_train(RECIPE, *port_args(tmp_path), "data.task=jsonl", f"data.train_path={path}",
                    f"data.eval_path={path}", "eval.num_prompts=2", "sft.eval_prompts=2", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "row 3" in r.stderr and "'prompt'" in r.stderr and "data.prompt_key" in r.stderr


def test_unscorable_label_fails_before_training(tmp_path):
    rows = [{"prompt": "001+002=", "label": "3"}, {"prompt": "010+020=", "label": "abc"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = moerl_train(RECIPE, *port_args(tmp_path), "data.task=jsonl", f"data.train_path={path}",
                    f"data.eval_path={path}", "eval.num_prompts=2", "sft.eval_prompts=2", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "row 2" in r.stderr and "'abc'" in r.stderr and "reward.function=arithmetic" in r.stderr
    assert "sft step" not in r.stdout


USER_REWARD = """
import os


def leading_int_match(response, label, metadata):
    with open(os.environ["MOERL_TEST_REWARD_LOG"], "a") as f:
        f.write(label + "\\n")
    digits = ""
    for ch in response.strip():
        if not ch.isdigit():
            break
        digits += ch
    return {"score": float(digits != "" and int(digits) == int(label)), "response_chars": float(len(response))}


def group_leading_int_match(responses, label, metadata):
    return [leading_int_match(r, label, metadata) for r in responses]


def one_arg(response):
    return 0.0
"""


def test_user_reward_with_a_wrong_path_or_signature_is_refused_before_any_work(tmp_path):
    f = tmp_path / "outside" / "my_reward.py"
    f.parent.mkdir()
    f.write_text(USER_REWARD)
    for spec, needle in ((f"{tmp_path}/missing.py:fn", "missing.py"), (f"{f}:nope", "nope"),
                         (f"{f}:one_arg", "one_arg"), ("no_such_package_xyz.mod:fn", "no_such_package_xyz")):
        r = moerl_train(RECIPE, *port_args(tmp_path), f"reward.function={spec}", timeout=120)
        assert r.returncode == 2, (spec, r.stderr[-2000:])
        assert "reward.function" in r.stderr and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "rollout:" not in r.stdout and not (tmp_path / "run" / "tokenizer").exists()


@pytest.mark.slow
# both are slow_extra (not in CI; CI's 30-min budget): loading reward.function from a file and refusing a wrong
# path or signature are fast tests (test_rewards, test_main_job ..._refused_before_any_work), per-sample scoring in
# the reward workers is every end-to-end run's. What leaves CI: a user's file scoring a whole run, group functions.
@pytest.mark.parametrize("fn, group", [pytest.param("leading_int_match", False, marks=pytest.mark.slow_extra),
                                       pytest.param("group_leading_int_match", True, marks=pytest.mark.slow_extra)])
def test_user_reward_from_a_file_outside_the_package_scores_the_run(tmp_path, fn, group):
    """reward.function=/path/file.py:fn: the run's reward workers load it and every rollout and eval
    response goes through it; its extra metric is logged (reward/response_chars). A group function
    (reward.group=true) scores each prompt's group in RL and each greedy eval answer as a group of one."""
    f = tmp_path / "outside" / "my_reward.py"
    f.parent.mkdir()
    f.write_text(USER_REWARD)
    log = tmp_path / "calls.txt"
    r = moerl_train(RECIPE, *port_args(tmp_path), *FAST, f"reward.function={f}:{fn}", f"reward.group={group}",
                    "log.samples=true", timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                              MOERL_TEST_REWARD_LOG=str(log)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    calls = log.read_text().splitlines()
    # 3 RL steps x 4 prompts x 8 samples, plus the greedy evals (SFT evals of 20 prompts, RL evals of 40)
    assert len(calls) >= 3 * 4 * 8 + 40
    trained = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(trained) == 3 * 4 * 8 and {t["reward"] for t in trained} <= {0.0, 1.0}
    assert re.search(r"\(reward \d+\.\d+s\)", r.stdout), r.stdout[-2000:]  # reward time in the step line
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert "reward/response_chars" in ea.Tags()["scalars"]


def test_port_in_use(tmp_path):
    args = port_args(tmp_path)
    port = int(args[2].split("=")[1]) + 1  # second server's port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        t0 = time.time()
        r = moerl_train(RECIPE, *args, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"port {port}" in r.stderr and "rollout.base_port" in r.stderr
    assert "sft step" not in r.stdout  # failed before any compute
    assert time.time() - t0 < 120


# ----------------------------------------------------------------------------- end to end, slow
def _step_lines(stdout: str) -> list[str]:
    """Per-step lines without wall-clock parts (timings differ run to run)."""
    out = []
    for line in stdout.splitlines():
        if " step " in line or "EVAL" in line or "STEP-0" in line:
            line = re.sub(r"^\[moerl [0-9:]+\] ", "", line)
            line = re.sub(r"\|[^|]*\d+\.\d+s[^|]*", "|", line)  # time breakdown and eta
            line = re.sub(r"\([\d.]+ steps/s, elapsed \d+s", "(", line)
            line = re.sub(r"\beta [0-9hms]+", "eta", line)  # whole-second ETA (e.g. "eta 1s")
            # the servers batch concurrent requests as they arrive, so the server-side log-probs (not
            # the samples, which come from per-request seeds) can move in the last bits
            line = re.sub(r"(lp_diff|mis_kl) \S+", r"\1", line)  # mis_kl: from the same server log-probs
            line = re.sub(r"STEP-0 CHECK: .*?: (PASS|FAIL);", r"STEP-0 CHECK: \1;", line)
            out.append(line)
    return out


@pytest.mark.slow
def test_short_run_end_to_end_and_reproducible(tmp_path, fast_main_job):
    """Two runs with the same seed give the same numbers step by step; the second runs in
    train.mode=async with max_staleness=0 (the producer may start each batch as soon as the weights
    are pushed, with in-flight weight updates on), which must not change a number either. The first
    (sync) run is the session's shared FAST run (conftest.fast_main_job)."""
    out0, run = fast_main_job
    runs = [out0]
    mode = ["train.mode=async", "train.max_staleness=0", "log.samples=true"]
    r = moerl_train(RECIPE, *port_args(tmp_path / "r1"), *FAST, *mode, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs.append(r.stdout)
    out = runs[0]
    assert "EVAL after warm start" in out and "EVAL after RL" in out
    m = re.search(r"STEP-0 CHECK: .*mean \|diff\| ([0-9.e+-]+) .*: (PASS|FAIL); .*sum \|log ratio\| = (\S+) .*: (PASS|FAIL)", out)
    assert m, out[-3000:]
    assert float(m.group(1)) <= 1e-5 and m.group(2) == "PASS"
    assert float(m.group(3)) == 0.0 and m.group(4) == "PASS"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step0_check"]["logprob_pass"] and summary["step0_check"]["ratio_pass"]
    assert (run / "hf_export" / "model.safetensors").is_file()
    assert any((run / "checkpoints").iterdir())
    assert list((run / "tensorboard").rglob("events.out.tfevents*"))
    # same seed -> the same numbers, step by step (sync and async with max_staleness 0)
    assert _step_lines(runs[0]) == _step_lines(runs[1])
    assert "stale 0.00" in runs[1]
    trained = [json.loads(line) for line in (tmp_path / "r1" / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(trained) == 3 * 4 * 8 and all(set(t["token_versions"]) == {t["trainer_version"]} for t in trained)
    # the HF export loads in transformers and matches the trainer's final weights via the server path
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "hf_export")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000


def _children_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _start(tmp_path, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moerl.cli", "train", RECIPE, *port_args(tmp_path), *extra],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    return proc, tmp_path / "train.log"


def _wait_for(log_path: Path, pattern: str, proc, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if re.search(pattern, log_path.read_text()):
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited early:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {pattern!r}:\n{log_path.read_text()[-3000:]}")


@pytest.mark.slow
def test_killed_server_is_restarted_and_the_run_finishes(tmp_path):
    """rollout.failover=true (the default): kill -9 of a server mid-run; the run goes on, the server is
    restarted with the current weights and rejoins, and the job ends normally."""
    # no SFT warm start (not checked here; the kill, restart and rejoin happen in RL). The run must outlast
    # the restart: measured 8.5 s from the kill to "back in the router" = 14 RL steps of this run, so 60
    # steps leave the restart 4x its time (200 steps ran ~85 s past the rejoin, only waiting)
    proc, log = _start(tmp_path, *FAST[:-2], "sft.enabled=false", "train.num_steps=60", "eval.every_steps=0")
    try:
        _wait_for(log, r"step 2/60", proc)
        servers = [c for c in _children_of(proc.pid) if "moerl.rollout.server" in " ".join(c.cmdline())]
        assert len(servers) == 2
        servers[1].send_signal(signal.SIGKILL)
        _wait_for(log, r"rollout failover: server \d \(\S+\) back in the router", proc)  # restarted, given the current weights, back in the router
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    for event in ("died (signal SIGKILL", "restarted as pid", "restored to weights version",
                  "back in the router with weights version"):
        assert event in text, (event, text[-3000:])
    assert "step 60/60" in text and "EVAL after RL" in text
    time.sleep(1)
    assert not _children_of(proc.pid)


@pytest.mark.slow
# slow_extra (CI's 30-min budget): a killed server with failover is in CI
# (test_killed_server_is_restarted_and_the_run_finishes, test_failover); what leaves CI is the error text of a run
# without failover whose server dies
@pytest.mark.slow_extra
def test_killed_server_is_named(tmp_path):
    """rollout.failover=false: a dead server ends the run with exit code 1 and is named."""
    # no SFT warm start: the kill lands in RL, and nothing here reads the warm start
    proc, log = _start(tmp_path, *FAST[:-2], "sft.enabled=false", "train.num_steps=400", "eval.every_steps=0",
                       "rollout.failover=false")
    try:
        _wait_for(log, r"step 2/400", proc)
        servers = [c for c in _children_of(proc.pid) if "moerl.rollout.server" in " ".join(c.cmdline())]
        assert len(servers) == 2
        victim = servers[1]
        port = re.search(r"--port (\d+)", " ".join(victim.cmdline())).group(1)
        victim.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 1, text[-3000:]
    assert "RolloutServerDiedError" in text and f":{port}" in text and "SIGKILL" in text, text[-3000:]
    time.sleep(1)
    assert not _children_of(proc.pid)


@pytest.mark.slow
# slow_extra (CI's 30-min budget): the rollout cluster's own Ctrl-C shutdown (one server and the router;
# KeyboardInterrupt) is the fast suite's test_rollout_cluster
# test_ctrl_c_shuts_the_cluster_down_then_raises_keyboardinterrupt. What leaves CI: Ctrl-C of the whole `moerl train`
# process tree (reward workers included, exit code 130, 'interrupted').
@pytest.mark.slow_extra
def test_ctrl_c_leaves_no_process(tmp_path):
    # no SFT warm start: the Ctrl-C lands in RL, and nothing here reads the warm start
    proc, log = _start(tmp_path, *FAST[:-2], "sft.enabled=false", "train.num_steps=400", "eval.every_steps=0")
    try:
        _wait_for(log, r"step 2/400", proc)
        kids = _children_of(proc.pid)
        assert len(kids) >= 3  # 2 servers + router
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, log.read_text()[-3000:]
    assert "interrupted" in log.read_text()
    gone, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


# CPU seconds (user + sys) of the whole demo job, every process it starts included: 10 minutes on the issue's
# slow 2-core machine (each step 2.8x slower than this machine's quiet figures) with no overlap between
# processes (parallelism 1, the worst case: a job pinned to one core) allows 600 s / 2.8 = 214 s
DEMO_CPU_BUDGET_S = 600 / 2.8


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@pytest.mark.demo
def test_full_demo_recipe_rl_gain(tmp_path):
    """The README's main job exactly as shipped (only the run dir and ports changed): >= 200 held-out
    prompts, RL raises greedy accuracy by >= 10 points; RL ends at eval.stop_at_gain (+15) on an eval
    step with that gain; the whole job (servers, router, reward workers included) takes <= 214 CPU-seconds
    (10 minutes on the issue's slow machine, DEMO_CPU_BUDGET_S) and <= 20 wall minutes on 2 loaded cores."""
    t0, cpu0 = time.time(), _children_cpu_s()
    r = moerl_train(RECIPE, *port_args(tmp_path), timeout=1500)
    elapsed, cpu_s = time.time() - t0, _children_cpu_s() - cpu0  # every process of the job was reaped
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(json.dumps(summary, indent=2))
    print("\n".join(line for line in r.stdout.splitlines() if "EVAL" in line or "stop_at_gain" in line))
    print(f"wall {elapsed:.0f} s, CPU {cpu_s:.0f} s (budget {DEMO_CPU_BUDGET_S:.0f} s)")
    assert "after warm start" in r.stdout and "after RL" in r.stdout
    m = re.search(r"EVAL after RL: greedy accuracy [0-9.]+ on (\d+) held-out prompts", r.stdout)
    assert m and int(m.group(1)) >= 200
    assert summary["accuracy_after_rl"] - summary["accuracy_after_warm_start"] >= 0.10, summary
    assert summary["step0_check"]["logprob_pass"] and summary["step0_check"]["ratio_pass"]
    stop = summary.get("stopped_at_step")
    steps = [int(x) for x in re.findall(r"\] step (\d+)/600 ", r.stdout)]
    if stop is not None:  # ended early: on an eval step (every 25) whose greedy eval is the final one
        assert stop % 25 == 0 and steps[-1] == stop and len(steps) == stop, (stop, steps[-3:])
        assert summary["accuracy_after_rl"] - summary["accuracy_after_warm_start"] >= 0.15 - 1e-9, summary
        evals = re.findall(r"step %d/600 .*EVAL greedy acc ([0-9.]+)" % stop, r.stdout)
        assert evals and abs(float(evals[0]) - summary["accuracy_after_rl"]) < 1e-4, evals
    else:
        assert len(steps) == 600
    assert cpu_s <= DEMO_CPU_BUDGET_S, cpu_s
    assert elapsed <= 20 * 60, elapsed


@pytest.mark.demo
def test_async_demo_rl_gain(tmp_path):
    """The demo recipe in train.mode=async with max_staleness=1 (rollout of the next batch and in-flight
    weight updates while the trainer trains): RL raises greedy accuracy by >= 10 points and no trained
    token is more than one version old."""
    r = moerl_train(RECIPE, *port_args(tmp_path), "train.mode=async", "train.max_staleness=1", "log.samples=true",
                    timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(json.dumps(summary, indent=2))
    assert summary["accuracy_after_rl"] - summary["accuracy_after_warm_start"] >= 0.10, summary
    ages = {t["trainer_version"] - v for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
            for t in [json.loads(line)] for v, m in zip(t["token_versions"], t["loss_mask"]) if m}
    assert max(ages) <= 1, ages


def warm_from(fast_main_job) -> list[str]:
    """Overrides that start RL from the SFT warm start of the session's shared FAST run
    (conftest.fast_main_job: FAST's 30-step SFT of this recipe and seed, which these tests would repeat
    in every run) instead of running SFT again (CI time)."""
    return [f"model.init_from={fast_main_job[1] / 'hf_warm_start'}", "sft.enabled=false"]


@pytest.mark.slow
# slow_extra (CI's 30-min budget): the step-0 check's arithmetic is a fast test (test_fp8_rollout
# test_step0_logprob_tolerance_of_fp8_and_bf16_rollout_weights);
# what leaves CI is its reading of the first of several optimizer updates in one step, end to end
@pytest.mark.slow_extra
def test_step0_check_reads_the_first_of_several_updates(tmp_path, fast_main_job):
    """16 samples per step with train.global_batch_size=8: two optimizer updates per step. The step-0
    check must read the first update's ratio (exactly 1), not the second's (after an optimizer step):
    issue #13 defect 4 printed 'sum |log ratio| = 0.973 ... FAIL' here."""
    fast = [a for a in FAST if not a.startswith(("rollout.rollout_batch_size", "train.global_batch_size",
                                                 "train.micro_batch_size"))]
    r = moerl_train(RECIPE, *port_args(tmp_path), *fast, *warm_from(fast_main_job), "rollout.rollout_batch_size=2",
                    "rollout.n_samples_per_prompt=8", "train.global_batch_size=8", "train.micro_batch_size=8",
                    "train.num_steps=1", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = re.search(r"sum \|log ratio\| = (\S+) \(exactly 1\): (PASS|FAIL)", r.stdout)
    assert m and float(m.group(1)) == 0.0 and m.group(2) == "PASS", r.stdout[-3000:]


@pytest.mark.slow
# rloo-* and reinforcepp-baseline-* are slow_extra too (CI's 30-min budget): every estimator and loss is checked
# against hand-worked values in the fast suite (test_estimators, test_algorithms); gae-ppo-critic stays in CI (the
# critic's training, PPO's clip, and the reference policy's reset, algorithm.reference_reset_every, end to end).
# What leaves CI: those combinations run through `moerl train`.
@pytest.mark.parametrize("algo", [
    pytest.param(["algorithm.advantage_estimator=rloo", "algorithm.policy_loss=ppo", "algorithm.eps_clip_low=0.2",
                  "algorithm.eps_clip_high=0.28", "algorithm.dual_clip_c=3.0", "algorithm.whiten_advantages=true",
                  "algorithm.overlong_buffer_len=4"], marks=pytest.mark.slow_extra),
    pytest.param(["algorithm.advantage_estimator=reinforce_plus_plus_baseline", "algorithm.policy_loss=gspo_token",
                  "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.01", "algorithm.reference_reset_every=2"],
                 marks=pytest.mark.slow_extra),
    # slow_extra (not in CI): CISPO's loss and the entropy bonus against hand-worked values in the fast suite
    pytest.param(["algorithm.advantage_estimator=reinforce_plus_plus", "algorithm.policy_loss=cispo",
                  "algorithm.entropy_coef=0.01"], marks=pytest.mark.slow_extra),
    ["algorithm.advantage_estimator=gae", "algorithm.policy_loss=ppo", "algorithm.eps_clip_low=0.2",
     "algorithm.eps_clip_high=0.2", "algorithm.lam=0.95", "critic.warmup_steps=1",
     "algorithm.overlong_buffer_len=4",  # the 30-step SFT model scores ~0: a length penalty gives returns != 0
     "algorithm.reference_reset_every=2"],  # the reset in CI (the reinforcepp-baseline case is slow_extra)
], ids=["rloo-ppo-dualclip-whiten-overlong", "reinforcepp-baseline-gspo_token-kl_in_reward-reset",
        "reinforcepp-cispo-entropy", "gae-ppo-critic"])
def test_estimators_and_losses_run_end_to_end(tmp_path, algo, fast_main_job):
    """Each estimator / loss family runs a short main job from the recipe keys and logs its metrics (RL from
    the shared FAST run's SFT warm start: the SFT phase does not depend on the algorithm keys)."""
    r = moerl_train(RECIPE, *port_args(tmp_path), *FAST, *warm_from(fast_main_job), *algo, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "EVAL after RL" in r.stdout and "STEP-0 CHECK" in r.stdout
    if "algorithm.advantage_estimator=gae" in algo:  # the critic trains, and exports to transformers
        vf = _tb_scalars(tmp_path / "run", "critic/vf_loss")
        assert len(vf) == 3 and all(math.isfinite(v) and v > 0 for v in vf.values()), vf
        from transformers import AutoModelForTokenClassification

        assert AutoModelForTokenClassification.from_pretrained(tmp_path / "run" / "hf_critic").config.num_labels == 1
        assert (tmp_path / "run" / "checkpoints" / "step_3" / "critic").is_dir()
    if "algorithm.reference_reset_every=2" in algo:
        assert "reference policy reset to the policy of step 2" in r.stdout
        assert (tmp_path / "run" / "reference_resets" / "step_2" / "model.safetensors").is_file()


def _tb_scalars(run_dir, suffix: str) -> dict:
    """step -> value of the TensorBoard scalar whose tag ends with ``suffix`` (exactly one such tag)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tags = {}, set()
    for f in sorted((run_dir / "tensorboard").iterdir()):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.endswith(suffix):
                tags.add(tag)
                out.update({e.step: e.value for e in acc.Scalars(tag)})
    assert len(tags) == 1, (suffix, tags)
    return out


CHAIN_SUM = str(REPO / "configs" / "tiny_chain_sum.yaml")


@pytest.mark.slow
# slow_extra (CI's 30-min budget): the reasoning-gym task (rows and scores against the library) is a fast test
# (tests/test_data.py); what leaves CI is its recipe's short end-to-end run
@pytest.mark.slow_extra
def test_reasoning_gym_recipe_short_run(tmp_path):
    """configs/tiny_chain_sum.yaml, shortened: reasoning-gym prompts and labels are generated offline,
    scored by the dataset's own verifier in the reward workers, and the run ends with both evals."""
    r = moerl_train(CHAIN_SUM, *port_args(tmp_path), "sft.max_steps=20", "sft.eval_every=10", "sft.eval_prompts=20",
                    "train.num_steps=2", "eval.num_prompts=20", "data.num_eval=20", "data.reasoning_gym.size=200",
                    "rollout.rollout_batch_size=4", "train.global_batch_size=32", "train.micro_batch_size=16",
                    "algorithm.filter_uniform_groups=false", "log.samples=true",
                    "profile.steps=[2,2]", "hardware.peak_bf16_tflops=2.0", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "EVAL after warm start" in r.stdout and "EVAL after RL" in r.stdout
    rows = [json.loads(x) for x in (tmp_path / "run" / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 200 and rows[0]["prompt"].startswith("Calculate ")
    assert json.loads(rows[0]["metadata"])["source_dataset"] == "basic_arithmetic"
    trained = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(trained) == 2 * 4 * 8 and all(0.0 <= t["reward"] <= 1.0 for t in trained)
    # issue #17: MFU (against the recipe's made-up 2 TFLOP/s peak) and tokens/s/device in the step line and
    # TensorBoard; generated tokens equal the trained samples' response lengths (samples.jsonl)
    perf = re.findall(r"perf step [\d.]+s mfu ([\d.e+-]+) tflops/dev ([\d.e+-]+) tok/s/dev rollout ([\d.e+-]+) "
                      r"train ([\d.e+-]+) mem peak .*update [\d.]+ .*GiB", r.stdout)
    assert len(perf) == 2 and all(float(x) > 0 for p in perf for x in p), r.stdout[-3000:]
    run = tmp_path / "run"
    tb = {k: _tb_scalars(run, k) for k in ("perf/mfu", "perf/tflops_per_device", "perf/generated_tokens",
                                           "time/rollout", "perf/tokens_per_s_per_device_rollout",
                                           "perf/tokens_per_s_per_device_train", "memory/update_peak_gib")}
    for step in (1, 2):
        assert tb["perf/generated_tokens"][step] == sum(len(t["loss_mask"]) for t in trained if t["step"] == step)
        assert tb["perf/mfu"][step] == pytest.approx(tb["perf/tflops_per_device"][step] / 2.0, rel=1e-5)
        assert tb["perf/tokens_per_s_per_device_rollout"][step] == pytest.approx(
            tb["perf/generated_tokens"][step] / tb["time/rollout"][step] / 2, rel=1e-5)  # 2 servers
        assert tb["perf/tokens_per_s_per_device_train"][step] > 0 and tb["memory/update_peak_gib"][step] > 0.1
    # the profiled step (2) left a Chrome trace of rank 0 with the phase names
    trace = json.loads((run / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step 2", "rollout", "log_prob", "update", "weight_sync"} <= names and "step 1" not in names


def _demo_gain(recipe: str, tmp_path, overrides=(), minutes: float = 15) -> dict:
    """Run a demo recipe (run dir and ports changed, ``overrides`` added), print its figures, and assert
    that RL raises held-out greedy accuracy by >= 10 points over the warm start within ``minutes``."""
    t0, cpu0 = time.time(), _children_cpu_s()
    r = moerl_train(recipe, *port_args(tmp_path), *overrides, timeout=1500)
    elapsed = time.time() - t0
    print(f"CPU {_children_cpu_s() - cpu0:.0f} s (the whole job's process tree)")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(json.dumps(summary, indent=2))
    print("\n".join(line for line in r.stdout.splitlines() if "EVAL" in line))
    print(f"wall time {elapsed:.0f} s")
    assert summary["accuracy_after_rl"] - summary["accuracy_after_warm_start"] >= 0.10, summary
    assert elapsed <= minutes * 60, elapsed
    return summary


@pytest.mark.demo
def test_chain_sum_demo_rl_gain(tmp_path):
    """configs/tiny_chain_sum.yaml as shipped: RL raises held-out greedy accuracy by >= 10 points over the
    warm start within 15 minutes on 2 cores (issue #12)."""
    _demo_gain(CHAIN_SUM, tmp_path)


@pytest.mark.demo
def test_bf16_demo_rl_gain(tmp_path):
    """The demo recipe in BF16 (issue 14): model.params_dtype=bfloat16 (Megatron-Core mixed precision: BF16
    weights and compute, FP32 main params, grads and Adam) with rollout servers serving in bfloat16. RL
    raises held-out greedy accuracy by >= 10 points over the warm start within 30 minutes on 2 cores (measured
    with other jobs on the cores: 39.3% -> 60.3%, 1530 s, of which the BF16 warm start took 1550 SFT steps,
    485 s); the HF export is written in the params dtype (model.export_dtype unset)."""
    _demo_gain(RECIPE, tmp_path, ["model.params_dtype=bfloat16", "rollout.dtype=bfloat16"], minutes=30)
    assert json.loads((tmp_path / "run" / "hf_export" / "config.json").read_text())["dtype"] == "bfloat16"
    servers = sorted((tmp_path / "run" / "logs").glob("server_*.log"))
    assert servers and all("--dtype bfloat16" in p.read_text() for p in servers)


GAE_DEMO = ["algorithm.advantage_estimator=gae", "algorithm.policy_loss=ppo", "algorithm.eps_clip_low=0.2",
            "algorithm.eps_clip_high=0.2", "algorithm.lam=0.95", "algorithm.whiten_advantages=true",
            "critic.warmup_steps=5"]


@pytest.mark.demo
@pytest.mark.parametrize("overrides", [["algorithm.advantage_estimator=rloo"], GAE_DEMO], ids=["rloo", "gae-ppo-critic"])
def test_algorithm_demo_rl_gain(tmp_path, overrides):
    """The demo recipe with another estimator (issue #13): RLOO (with GSPO), and PPO with a Megatron critic
    (GAE, lambda 0.95, whitened advantages, 5 critic warm-up steps). RL raises held-out greedy accuracy by
    >= 10 points over the warm start, within 20 minutes on 2 cores."""
    _demo_gain(RECIPE, tmp_path, overrides, minutes=20)
    if "algorithm.advantage_estimator=gae" in overrides:
        vf = _tb_scalars(tmp_path / "run", "critic/vf_loss")
        steps = sorted(vf)
        early, late = steps[: len(steps) // 10], steps[-(len(steps) // 10):]
        print(f"critic vf_loss: first tenth {sum(vf[k] for k in early) / len(early):.4g}, "
              f"last tenth {sum(vf[k] for k in late) / len(late):.4g}")


@pytest.mark.parametrize("overrides, needles", [
    (["rollout.backend=sglang", "rollout.gpu_ids=[0,1]"], ["rollout.backend=sglang", "pip install", "sglang"]),
    (["rollout.weight_sync=distributed", "rollout.weight_sync_backend=nccl"], ["nccl", "CUDA", "gloo"]),
    (["rollout.backend=sglang", "rollout.gpu_ids=[0,1,2]", "rollout.server_tp_size=2"],
     ["rollout.gpu_ids", "multiple of", "server_tp_size"]),
    (["rollout.backend=sglang", "rollout.gpu_ids=[0,0]"], ["distinct", "[0, 0]"]),
    (["rollout.backend=sglang", "rollout.gpu_ids=[0,1]", "rollout.weight_sync=tensor"], ["weight_sync=tensor", "disk"]),
    (["rollout.weight_sync_bucket_mb=1e-9"], ["rollout.weight_sync_bucket_mb"]),
    (["model.params_dtype=float16"], ["model.params_dtype=float16", "loss scaling", "bfloat16"]),
])
def test_rollout_settings_this_machine_cannot_run_fail_before_any_work(tmp_path, overrides, needles):
    if "sglang" in " ".join(overrides) and importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    r = moerl_train(RECIPE, *port_args(tmp_path), *overrides, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "data").exists()  # nothing was written
