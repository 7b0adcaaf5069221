"""moerl.checkpoint.run_state: which checkpoint directories count as complete and which one resume=auto takes.

The end-to-end version (a finished run plus a hand-made step_5 without marker and a step_5.tmp, then resume=auto)
is tests/test_resume.py
test_resume_on_epoch_boundary_and_incomplete_checkpoint_skipped (slow_extra); this one is the rule itself,
on directories laid out by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moerl.checkpoint.run_state import COMPLETE_MARKER, list_complete_checkpoints, resolve_resume


def _ckpt(root, name, complete=True):
    d = root / name
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"x")
    if complete:
        (d / COMPLETE_MARKER).write_text("{}")
    return d


def test_incomplete_and_foreign_directories_are_skipped_and_order_is_sft_then_rl_by_step(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _ckpt(root, "step_1")
    _ckpt(root, "step_2", complete=False)      # killed before its marker
    _ckpt(root, "step_3.tmp")                  # a save cut short (even with a marker inside)
    _ckpt(root, "step_4.old")                  # the previous copy of a directory being replaced
    _ckpt(root, "step_10")                     # numeric order, not text order (step_10 > step_9)
    _ckpt(root, "step_9")
    _ckpt(root, "sft_step_5")
    _ckpt(root, "notes")                       # not a checkpoint name
    (root / "step_11").write_text("a file")    # not a directory
    # worked by hand: SFT checkpoints first, then RL by step; 2 (no marker), 3.tmp, 4.old, notes, the file out
    assert [d.name for d in list_complete_checkpoints(root)] == ["sft_step_5", "step_1", "step_9", "step_10"]
    err = capsys.readouterr()
    text = err.out + err.err
    assert "step_2" in text and COMPLETE_MARKER in text and "step_3.tmp" in text and "step_4.old" in text
    assert list_complete_checkpoints(tmp_path / "missing") == []


def test_resume_auto_takes_the_newest_complete_and_a_path_without_marker_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert resolve_resume(SimpleNamespace(resume="auto"), run) is None  # nothing saved yet: a fresh start
    assert f"resume=auto: no complete checkpoint in {run / 'checkpoints'}: starting from the beginning" in \
        capsys.readouterr().out  # said, not silent
    _ckpt(run / "checkpoints", "sft_step_30")
    _ckpt(run / "checkpoints", "step_2")
    _ckpt(run / "checkpoints", "step_3", complete=False)
    assert resolve_resume(SimpleNamespace(resume="auto"), run) == run / "checkpoints" / "step_2"
    assert resolve_resume(SimpleNamespace(resume="none"), run) is None
    explicit = run / "checkpoints" / "sft_step_30"
    assert resolve_resume(SimpleNamespace(resume=str(explicit)), run) == explicit
    with pytest.raises(FileNotFoundError, match="step_3 is not a complete moerl checkpoint"):
        resolve_resume(SimpleNamespace(resume=str(run / "checkpoints" / "step_3")), run)


def test_ctrl_c_names_what_resume_auto_would_continue_from(tmp_path, capsys):
    """moerl train's Ctrl-C line (exit code 130) says whether a checkpoint is there to continue from."""
    from moerl.cli import _run_train

    def interrupted():
        raise KeyboardInterrupt

    run = tmp_path / "run"
    assert _run_train(interrupted, run_dir=run) == 130
    err = capsys.readouterr().err
    assert "interrupted; rollout servers and router stopped" in err and "no checkpoint was saved" in err
    _ckpt(run / "checkpoints", "step_10")
    _ckpt(run / "checkpoints", "step_15", complete=False)  # cut by the interrupt: not a resume point
    assert _run_train(interrupted, run_dir=run) == 130
    err = capsys.readouterr().err
    assert f"the newest complete checkpoint is {run / 'checkpoints' / 'step_10'}" in err and "resume=auto" in err


def test_a_resume_names_every_recipe_key_that_changed(tmp_path, capsys):
    """moerl.train.setup: a resumed run whose recipe differs from the run's recipe.yaml logs each changed key
    (worked by hand below) and keeps the earlier file; the same recipe says nothing."""
    from moerl.config.loader import load_config
    from moerl.train.setup import _note_recipe_changes, recipe_changes

    assert recipe_changes({"a": 1, "b": {"c": 2, "d": 3}, "gone": 0}, {"a": 1, "b": {"c": 5, "d": 3}, "new": [1]}) == \
        ["b.c: 2 -> 5", "new: '<unset>' -> [1]", "gone: 0 -> '<unset>'"]
    before = load_config("configs/tiny_arith.yaml", [f"output_dir={tmp_path}", "train.mode=async"])
    before.save(str(tmp_path / "recipe.yaml"))
    same = load_config("configs/tiny_arith.yaml", [f"output_dir={tmp_path}", "train.mode=async", "resume=auto"])
    _note_recipe_changes(same, tmp_path)  # resume is not a change of the run
    assert capsys.readouterr().out == "" and not (tmp_path / "recipe.previous.yaml").exists()
    after = load_config("configs/tiny_arith.yaml", [f"output_dir={tmp_path}", "train.mode=sync", "resume=auto",
                                                    "rollout.rollout_batch_size=32"])
    _note_recipe_changes(after, tmp_path)
    out = capsys.readouterr().out
    assert "differs from the run's recipe.yaml in 2 key(s)" in out
    assert "rollout.rollout_batch_size: 16 -> 32" in out and "train.mode: 'async' -> 'sync'" in out
    assert (tmp_path / "recipe.previous.yaml").read_text() == before.to_yaml()
