"""tools/bench_async.py: the pure parts (RL window, idle measures, staleness, time model, cluster
table, targets, /proc parsing) on hand-worked numbers; no training runs."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_async", Path(__file__).resolve().parents[1] / "tools" / "bench_async.py")
ba = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ba)


def _step(k, t_log, R, L, U, W, **extra):
    return {"step": k, "t_log": t_log, "time/rollout": R, "time/log_prob": L, "time/update": U,
            "time/weight_sync": W, **extra}


# three sync steps: 0.6 + 0.2 + 0.1 + 0.1 = 1.0 s of phases, 0.05 s unmeasured between steps;
# step 1 starts at t = 100.0 and its events are written at 101.0; step 3 also evaluates for 2 s
STEPS = [
    _step(1, 101.00, 0.6, 0.2, 0.1, 0.1, **{"rollout/server_busy_frac": 1.0}),
    _step(2, 102.05, 0.6, 0.2, 0.1, 0.1, **{"rollout/server_busy_frac": 0.5}),
    _step(3, 105.10, 0.6, 0.2, 0.1, 0.1, **{"time/eval": 2.0, "rollout/server_busy_frac": 0.25}),
]


def test_rl_window_and_wall_exclude_the_final_eval():
    t0, t1 = ba.rl_window(STEPS)
    assert t0 == pytest.approx(100.0)  # 101.0 - 1.0 s of step-1 phases
    assert t1 == pytest.approx(103.1)  # 105.1 - 2.0 s eval
    assert ba.rl_wall(STEPS) == pytest.approx(3.1)
    # an eval in the middle (eval.every_steps) is taken out too
    mid = [dict(STEPS[0]), dict(STEPS[1], **{"time/eval": 0.5}), dict(STEPS[2], t_log=105.6)]
    assert ba.rl_wall(mid) == pytest.approx(3.1)
    with pytest.raises(ValueError):
        ba.rl_window([])


def test_phase_means_other_is_the_unmeasured_rest():
    ph = ba.phase_means(STEPS)
    assert ph["R"] == pytest.approx(0.6) and ph["L"] == pytest.approx(0.2)
    assert ph["U"] == pytest.approx(0.1) and ph["W"] == pytest.approx(0.1)
    assert ph["O"] == pytest.approx(3.1 / 3 - 1.0)  # 0.0333: the 2 x 0.05 s gaps over 3 steps


def test_time_weighted_busy():
    # batches handed over at 100.6, 101.65, 102.70 (t_log - (L + U + W [+ eval])) after the start at 100.0:
    # intervals 0.6, 1.05, 1.05 with busy fractions 1.0, 0.5, 0.25
    want = (0.6 * 1.0 + 1.05 * 0.5 + 1.05 * 0.25) / 2.7
    assert ba.time_weighted_busy(STEPS) == pytest.approx(want)


def test_staleness_summary_is_token_weighted():
    steps = [{"staleness/mean": 0.0, "staleness/max": 0.0, "staleness/tokens_0": 100.0},
             {"staleness/mean": 0.5, "staleness/max": 1.0, "staleness/tokens_0": 150.0, "staleness/tokens_1": 150.0},
             {"staleness/mean": 2.0, "staleness/max": 2.0, "staleness/tokens_2": 100.0}]
    mean, mx = ba.staleness_summary(steps)
    assert mean == pytest.approx((0 + 0.5 * 300 + 2.0 * 100) / 500)  # 0.7
    assert mx == 2.0
    assert ba.staleness_summary([{}]) == (0.0, 0.0)


def test_interp():
    s = [(10.0, 1.0), (12.0, 3.0), (14.0, 3.0)]
    assert ba.interp(s, 11.0) == pytest.approx(2.0)
    assert ba.interp(s, 9.0) == 1.0 and ba.interp(s, 20.0) == 3.0
    assert ba.interp(s, 13.5) == pytest.approx(3.0)
    assert ba.interp([], 1.0) == 0.0


def test_overlapped_step_pairs_and_buffered():
    R, T = [0.4, 0.8], [0.5, 0.5]
    # foreground push (both sides wait W = 0.1): pairs max(0.5, 0.6) = 0.6 twice, max(0.9, 0.6) = 0.9 twice
    assert ba.overlapped_step(R, T, 0.1, 0.1, buffered=False) == pytest.approx(0.75)
    # buffered: max(mean R 0.6 + 0.1, mean T 0.5 + 0.1)
    assert ba.overlapped_step(R, T, 0.1, 0.1, buffered=True) == pytest.approx(0.7)
    # background push: trainer pays 0.02 (export), rollout 0.08 (push): pairs max(0.48, 0.52) = 0.52 twice,
    # max(0.88, 0.52) = 0.88 twice -> 0.70; buffered max(0.68, 0.52) = 0.68
    assert ba.overlapped_step(R, T, 0.02, 0.08, buffered=False) == pytest.approx(0.70)
    assert ba.overlapped_step(R, T, 0.02, 0.08, buffered=True) == pytest.approx(0.68)
    with pytest.raises(ValueError):
        ba.overlapped_step([], T, 0.1, 0.1, buffered=True)


def test_push_phase_and_split():
    steps = [dict(STEPS[0], **{"rollout/push_s": 0.0}),  # no update before step 1
             dict(STEPS[1], **{"rollout/pause_s": 0.01, "rollout/push_s": 0.05, "rollout/continue_s": 0.01}),
             dict(STEPS[2], **{"rollout/pause_s": 0.0, "rollout/push_s": 0.03, "rollout/continue_s": 0.0})]
    assert ba.push_phase(steps) == pytest.approx((0.07 + 0.03) / 2)
    assert ba.push_phase(STEPS) == 0.0
    assert ba.weight_update_split({"W": 0.1}, 0.05, True) == pytest.approx((0.05, 0.05))
    assert ba.weight_update_split({"W": 0.1}, 0.05, False) == (0.1, 0.1)
    assert ba.weight_update_split({"W": 0.1}, 0.3, True) == (0.0, 0.1)  # never more than W
    assert ba.background_push_of(["rollout.weight_sync=tensor"])
    assert not ba.background_push_of(["rollout.background_push=false"])
    assert ba.background_push_of(["rollout.background_push=false", "rollout.background_push=null"])


def test_time_model_hand_worked():
    # phases R 0.6, L 0.2, U 0.1, W 0.1, O 0.0333; sync step = 3.1 / 3 = 1.0333; foreground push
    m = ba.time_model(STEPS, producer_cpu_per_step=0.05, background_push=False)
    O = 3.1 / 3 - 1.0
    assert m["sync_step"] == pytest.approx(3.1 / 3)
    T = 0.2 + 0.1 + O + 0.05  # 0.3833 < R = 0.6: the rollout side bounds the overlapped step
    assert T < 0.6
    assert m["steps"]["async_s1"] == pytest.approx(0.1 + 0.6)
    assert m["steps"]["one_step_off"] == pytest.approx(0.7)
    assert m["steps"]["async_s2"] == pytest.approx(0.7)
    # wall: step 1 is a whole sync step, then 2 overlapped steps
    assert m["walls"]["async_s1"] == pytest.approx(3.1 / 3 + 2 * 0.7)
    assert m["ratios"]["async_s1"] == pytest.approx(3.1 / (3.1 / 3 + 1.4))
    assert m["steady_ratios"]["async_s1"] == pytest.approx((3.1 / 3) / 0.7)
    w = m["what_if_ratios"]  # steady state from the means: R 0.6, T = L+U+O 0.3333, W 0.1, P 0.05
    assert w["as measured"] == pytest.approx((3.1 / 3) / 0.7)
    assert w["producer off the trainer core"] == pytest.approx((3.1 / 3) / 0.7)
    assert w["push does not pause generation"] == pytest.approx((3.1 / 3) / 0.6)  # max(0.6, 0.4833)
    assert w["both"] == pytest.approx((3.1 / 3) / 0.6)
    # a trainer-bound case: producer CPU large enough to exceed R
    m2 = ba.time_model(STEPS, producer_cpu_per_step=0.5, background_push=False)
    assert m2["steps"]["async_s2"] == pytest.approx(0.1 + 0.2 + 0.1 + O + 0.5)
    # background push with Wp 0.04 of W 0.1: rollout side 0.6 + 0.04, trainer side 0.3333 + 0.5 + 0.06
    steps = [dict(s, **{"rollout/push_s": 0.04}) for s in STEPS]
    m3 = ba.time_model(steps, producer_cpu_per_step=0.5, background_push=True)
    assert (m3["We"], m3["Wp"]) == pytest.approx((0.06, 0.04))
    assert m3["steps"]["async_s2"] == pytest.approx(0.2 + 0.1 + O + 0.5 + 0.06)
    m4 = ba.time_model(steps, producer_cpu_per_step=0.05, background_push=True)
    assert m4["steps"]["async_s1"] == pytest.approx(0.64)  # rollout-bound: R + Wp
    assert m4["what_if_ratios"]["push does not pause generation"] == pytest.approx((3.1 / 3) / 0.6)


def test_time_model_producer_on_the_rollout_core():
    # rollout.producer_cpu_affinity = the rollout core: P 0.05 joins R (0.6 + 0.05 + Wp 0.04), T loses it
    steps = [dict(s, **{"rollout/push_s": 0.04}) for s in STEPS]
    m = ba.time_model(steps, producer_cpu_per_step=0.05, background_push=True, producer_on_rollout=True)
    assert m["steps"]["async_s2"] == pytest.approx(0.6 + 0.05 + 0.04)
    O = 3.1 / 3 - 1.0
    w = m["what_if_ratios"]
    assert w["as measured"] == w["producer on the rollout core"] == pytest.approx((3.1 / 3) / 0.69)
    assert w["producer on the trainer core"] == pytest.approx((3.1 / 3) / max(0.64, 0.2 + 0.1 + O + 0.05 + 0.06))
    assert ba.producer_on_rollout_of(["rollout.producer_cpu_affinity=[1]"])
    assert ba.producer_on_rollout_of(["rollout.producer_cpu_affinity=[ 1 ]"])
    assert not ba.producer_on_rollout_of(["rollout.producer_cpu_affinity=[0]"])
    assert not ba.producer_on_rollout_of(["rollout.producer_cpu_affinity=[1]", "rollout.producer_cpu_affinity=null"])


def test_own_producer_step():
    m = ba.time_model(STEPS, producer_cpu_per_step=0.05, background_push=False)
    O = 3.1 / 3 - 1.0
    # the mode's own producer CPU 0.4: trainer side 0.2 + 0.1 + O + 0.4 = 0.7333 > R 0.6
    assert ba.own_producer_step(m, {"producer_cpu_per_step": 0.4}) == pytest.approx(0.1 + 0.7 + O)
    assert ba.own_producer_step(m, {"producer_cpu_per_step": 0.0}) == pytest.approx(0.7)
    assert ba.own_producer_step(m, {}) is None


def test_rel_error():
    assert ba.rel_error(1.5, 1.25) == pytest.approx(0.2)
    assert ba.rel_error(1.0, 1.25) == pytest.approx(0.2)


def test_cluster_rows():
    # one-device times R = 6, T = 2, push W = 0.5 on N = 8 devices
    r = ba.cluster_row(6.0, 2.0, 0.5, 8, 0.75)
    assert (r["rollout_devices"], r["trainer_devices"]) == (6, 2)
    assert r["sync_step"] == pytest.approx(1.0 + 1.0 + 0.5)
    assert r["async_step"] == pytest.approx(0.5 + 1.0)
    assert r["speedup"] == pytest.approx(2.5 / 1.5)
    assert r["colocated_sync_step"] == pytest.approx(8.0 / 8 + 0.5)
    assert r["speedup_vs_colocated"] == pytest.approx(1.5 / 1.5)
    r = ba.cluster_row(6.0, 2.0, 0.5, 8, 0.25)  # 2 rollout devices: rollout-bound
    assert r["async_step"] == pytest.approx(0.5 + 3.0) and r["sync_step"] == pytest.approx(3.0 + 2 / 6 + 0.5)
    # at least one device per side
    assert ba.cluster_row(1.0, 1.0, 0.0, 2, 0.9)["rollout_devices"] == 1
    # background push: the push part 0.4 on the rollout side, the export 0.1 on the trainer's
    r = ba.cluster_row(6.0, 2.0, 0.5, 8, 0.75, w_rollout=0.4)
    assert r["async_step"] == pytest.approx(max(1.0 + 0.4, 1.0 + 0.1)) and r["sync_step"] == pytest.approx(2.5)
    assert ba.balanced_fraction(6.0, 2.0) == pytest.approx(0.75)


def test_verdicts():
    v = ba.verdicts(sync_wall=16.0, async_wall=10.0, sync_acc=0.60, async_acc=0.575, predicted_ratio=1.8)
    by = {t["name"].split()[0]: t for t in v}
    assert by["speed-up"]["value"] == pytest.approx(1.6) and by["speed-up"]["pass"]
    assert by["accuracy"]["value"] == pytest.approx(-2.5) and by["accuracy"]["pass"]
    assert by["model"]["value"] == pytest.approx(0.125) and by["model"]["pass"]
    v = ba.verdicts(sync_wall=15.0, async_wall=10.0, sync_acc=0.60, async_acc=0.56, predicted_ratio=1.9)
    assert [t["pass"] for t in v] == [False, False, False]


def test_proc_parsers():
    line = "4242 (python -m x) S 4200 4242 4242 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 3 0 1000 0 0"
    assert ba.parse_task_stat(line) == (4200, 280)
    stat = ("cpu  10 0 10 100 0 0 0 0 0 0\n"
            "cpu0 5 1 2 50 9 1 1 1 0 0\n"
            "cpu1 5 0 8 50 0 0 0 0 0 0\n"
            "intr 1 2 3\n")
    assert ba.parse_proc_stat(stat) == {0: 5 + 1 + 2 + 1 + 1 + 1, 1: 13}


def test_fmt_table():
    t = ba.fmt_table(["a", "bb"], [["1", "22"], ["333", "4"]])
    assert t.splitlines() == ["|   a | bb |", "|-----|----|", "|   1 | 22 |", "| 333 |  4 |"]


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_proc_sampler_counts_threads_pinned_to_core_1_as_core_1_time():
    """The trainer's rollout-side threads (producer, weight push) run pinned to core 1: the sampler's
    threads_core1 series holds their CPU and not the main thread's, so the foreign load of core 1 does not
    count them (they had shown up as 10-15% 'foreign' load in the overlapped modes)."""
    sampler = ba.ProcSampler(os.getpid(), interval=0.05)
    done, release = threading.Event(), threading.Event()

    def burn():
        os.sched_setaffinity(0, {1})
        t = time.thread_time()
        while time.thread_time() - t < 0.4:
            pass
        done.set()
        release.wait()  # alive until sampled (a finished thread leaves /proc)

    t0 = time.time()
    sampler.sample()
    th = threading.Thread(target=burn)
    th.start()
    t_main = time.thread_time()
    while time.thread_time() - t_main < 0.2:  # the main thread burns too (not on the core-1 series)
        pass
    done.wait()
    sampler.sample()
    release.set()
    th.join()
    w = sampler.window(t0, time.time())
    assert 0.3 <= w["threads_core1"] <= 0.6, w
    # the process total and the per-thread counts are separate /proc reads, each rounded to clock ticks: they may
    # differ by a tick or two (under load 0.38 against 0.39 was seen)
    assert w["threads"] >= w["threads_core1"] - 2.5 / os.sysconf("SC_CLK_TCK") and w["main"] >= 0.15


def test_proc_sampler_counts_a_thread_that_started_and_ended_between_two_samples():
    """A thread born and gone between two /proc samples (each weight push's thread) is not in any per-thread
    snapshot; the threads series still holds its CPU (the process total includes exited threads). Before, the
    async benchmark showed 2 ms per step of 'other threads' where there were 11-12."""
    sampler = ba.ProcSampler(os.getpid(), interval=0.05)

    def burn():
        t = time.thread_time()
        while time.thread_time() - t < 0.3:
            pass

    t0 = time.time()
    sampler.sample()
    th = threading.Thread(target=burn)
    th.start()
    th.join()  # gone before the next sample: join returns before the kernel has released the task on a busy
    deadline = time.time() + 5  # machine, so wait until /proc no longer lists it
    while str(th.native_id) in os.listdir(f"/proc/{os.getpid()}/task") and time.time() < deadline:
        time.sleep(0.01)
    sampler.sample()
    w = sampler.window(t0, time.time())
    assert 0.25 <= w["threads"] <= 0.6, w
    assert all(x < 0.25 for x in w["per_thread"]) and w["main"] < 0.2, w  # no snapshot saw it; main only waited


def test_median_run_takes_one_whole_run():
    runs = [{"rl_wall_s": 9.0, "x": "a"}, {"rl_wall_s": 7.0, "x": "b"}, {"rl_wall_s": 8.0, "x": "c"}]
    m = ba.median_run(runs)
    assert m["x"] == "c" and m["rl_wall_s"] == 8.0 and m["repeat_walls_s"] == [9.0, 7.0, 8.0]
    assert ba.median_run(runs[:2])["x"] == "b"  # even count: the lower middle
    assert ba.median_run(runs[:1])["repeat_walls_s"] == [9.0]
    assert "accuracy_mean" not in m  # no accuracies: none made up
    runs = [dict(r, accuracy_after_rl=a) for r, a in zip(runs, (0.9, 0.4, 0.45))]
    m = ba.median_run(runs)  # the accuracy: every seed's and their mean (1.75 / 3), not the median run's (c: 0.45)
    assert m["accuracy_after_rl"] == 0.45 and m["repeat_accuracies"] == [0.9, 0.4, 0.45]
    assert m["accuracy_mean"] == pytest.approx(1.75 / 3)
    assert ba.median_run(runs[:2])["accuracy_mean"] == pytest.approx(0.65)  # median run b: 0.4
    assert ba.median_run(runs[:2])["accuracy_after_rl"] == 0.4
    assert "accuracy_mean" not in ba.median_run([runs[0], dict(runs[1], accuracy_after_rl=None)])  # one missing
    with pytest.raises(ValueError):
        ba.median_run([])


def test_round_seeds_vary_the_rl_seed_on_one_split():
    assert ba.round_seed_overrides(1234, 0) == ["seed=1234", "data.seed=1234"]
    assert ba.round_seed_overrides(1234, 2) == ["seed=1236", "data.seed=1234"]
    import yaml

    recipe_seed = yaml.safe_load((ba.REPO / ba.RECIPE).read_text())["seed"]
    assert ba.seeds_of([]) == (recipe_seed, recipe_seed)
    assert ba.seeds_of(["seed=3", "train.num_steps=3", "seed=9"])[0] == 9
    assert ba.seeds_of(["seed=9"])[1] == 9  # the recipe leaves data.seed null: the run seed
    assert ba.seeds_of(["seed=9", "data.seed=4"]) == (9, 4)
    assert ba.round_seed_overrides(9, 1, 4) == ["seed=10", "data.seed=4"]
    from moerl.config import load_config  # the overrides are recipe keys; the last one wins
    cfg = load_config(str(ba.REPO / ba.RECIPE), ["seed=5", *ba.round_seed_overrides(7, 1)])
    assert cfg.seed == 8 and cfg.data.seed == 7


def test_round_ratios_by_hand():
    per, pooled = ba.round_ratios([15.9, 14.5, 13.7], [10.4, 8.1, 8.7])
    assert per == pytest.approx([15.9 / 10.4, 14.5 / 8.1, 13.7 / 8.7])
    assert pooled == pytest.approx(44.1 / 27.2)
    with pytest.raises(ValueError):
        ba.round_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ba.round_ratios([], [])


def test_report_prints_each_seed_and_the_mean_difference():
    """--repeats 3: the table's accuracy is the mean over the rounds' seeds, and each round's accuracy and its
    difference to sync's are printed (worked by hand)."""
    def fig(walls, accs):
        runs = [{"rl_wall_s": w, "step_s": w / 40, "trainer_idle": 0.1, "server_idle_requests": 0.2,
                 "staleness_mean": 0.0, "staleness_max": 0, "samples": 5120, "accuracy_after_rl": a,
                 "phases": {k: 0.1 for k in "RLUWO"}, "resumed_segments": 0, "dropped_stale_groups": 0}
                for w, a in zip(walls, accs)]
        return ba.median_run(runs)

    res = {"modes": ["sync", "async_s1"], "repeats": 3, "seeds": [7, 8, 9], "data_seed": 7, "steps": 40,
           "samples_per_step": 128, "eval_prompts": 1000, "warm_start": "w", "servers_note": "",
           "figures": {"sync": fig([20.0, 18.0, 22.0], [0.455, 0.509, 0.492]),
                       "async_s1": fig([14.0, 13.0, 12.0], [0.500, 0.484, 0.453])}}
    text = ba.report(res)
    assert "RL seeds 7, 8, 9; one prompt split, data.seed 7" in text
    assert "  sync: 45.5 50.9 49.2; mean 48.5" in text
    assert "  async_s1: 50.0 (+4.5) 48.4 (-2.5) 45.3 (-3.9); mean 47.9" in text
    row = next(line for line in text.splitlines() if line.startswith("| async_s1"))
    assert " 47.9 |" in row and " 1.54 |" in row  # mean accuracy; 20.0 / 13.0 (the median runs' walls)
