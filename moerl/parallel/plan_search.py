"""``moerl plan RECIPE --search --world-size N``: which layout of N GPUs fits, and which is fastest.

Enumeration. Every (tp, pp, ep, etp, recompute, pipeline schedule) with tp <= hardware.gpus_per_node
(tensor parallelism stays inside a node), pp <= layers, ep dividing the experts and etp in {1, tp}
is written into a copy of the recipe (``parallel.*``, ``parallel.world_size = N``,
``train.pipeline_schedule``; DualPipe(V) candidates get ``train.pack=false``, which changes nothing
at pp > 1 where moerl pads micro-batches anyway) and kept only if the recipe's own validators accept
it (RecipeConfig: heads / vocabulary / FFN widths divisible by tp, sequence parallelism with MoE,
DualPipe rules, routing replay...) and ``check_world_size(N, trainable=False)`` returns its dp_size
(tiling and batch divisibility). A pipeline size that does not divide the layers gets the recipe's
first/last-stage layer counts when they split, else the most even split Megatron accepts
(``pipeline_split``). Each candidate is planned with moerl.parallel.memory_model.plan_recipe; those
whose busiest pipeline rank exceeds the usable GPU memory are dropped.

Step time (seconds per RL step, ``estimate_step_time``): compute at an assumed MFU plus the
communication volumes over the links their groups span, with no overlap between the two (an upper
bound; Megatron overlaps the DP and part of the EP traffic).

* FLOPs. One forward over T tokens: ``T * (2 * N_mm + L * 2 * nh * (d_qk + d_v) * S / 2)`` with N_mm the
  active parameters per token that are matrix multiplies (all but the input embedding), S the
  longest sample and S / 2 the mean causal context (Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters", eq. 3, per token). An RL step runs, on T = global_batch_size
  x S tokens: old log-probs (1 forward), reference log-probs (1, with algorithm.reference_policy),
  the update (3: forward + backward), recompute (+1 forward for full, + the attention part for
  selective), and for algorithm.advantage_estimator=gae the critic's values (1) and update (3 +
  recompute). compute = FLOPs / (N GPUs x peak dense BF16 x hardware.mfu). With precision.fp8 the
  transformer layers' GEMMs (all but precision.fp8_bf16_first/last_layers) run at the GPU's dense
  FP8 peak instead (attention's core and the output layer stay BF16).
* Pipeline bubble: the DualPipe README's per-rank bubble (moerl.pipeline.simulator.published_bubble)
  with per-chunk costs F = 1, B = 2, W = 1 (a DualPipeV chunk is half a stage: 0.5 / 1 / 0.5, on a
  2 pp pipe), over the m x 3 units of work of m micro-batches per rank: compute x (1 + bubble / 3m).
* TP (sequence parallel): per layer and pass 2 all-gathers + 2 reduce-scatters of the micro-batch's
  [T_mb, H] activations, (tp - 1) / tp of it per GPU each (Korthikanti et al. 2022, sec. 4.2.2).
* EP: per MoE layer and pass a dispatch and a combine all-to-all of the rank's T_mb / tp (sequence
  parallel) tokens x top-k copies x H, (ep - 1) / ep of it leaving the GPU; the part going to GPUs of
  other nodes runs at the inter-node bandwidth.
* PP: per micro-batch and pass one [T_mb / tp, H] tensor to the next stage (activations forward,
  gradients backward), twice for DualPipe(V)'s two chunks.
* DP: distributed optimizer: reduce-scatter of the FP32 gradients + all-gather of the parameters,
  (dp - 1) / dp of the rank's dense parameters x (4 + bytes(params)), experts over the expert-DP
  group; replicated optimizer: an all-reduce, 2 (dp - 1) / dp x 4 bytes per parameter.
* Links: Megatron's rank order tp-cp-ep-dp-pp puts a group of span s (tp: tp; dp: tp x dp; experts:
  etp x ep; pp: the world) inside one node when s <= hardware.gpus_per_node (NVLink,
  hardware.nvlink_gbs or the GPU table's), else on the inter-node network (hardware.inter_node_gbs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from moerl.parallel.memory_model import _DTYPE_BYTES, GIB, RecipePlan, plan_recipe, recipe_workload, total_params

__all__ = ["Candidate", "SearchResult", "pipeline_split", "estimate_step_time", "search_layouts", "format_search"]

RECOMPUTES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "dualpipe", "dualpipev")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_split(num_layers: int, pp_size: int, first: Optional[int] = None,
                   last: Optional[int] = None) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage) for ``pp_size`` stages:
    (None, None) when the layers split evenly, the given (first, last) when they split the layers
    (moerl.parallel.layout.pipeline_layer_range's rule), else the split whose largest stage is smallest
    (ties: the smaller last stage, which also holds the output layer); None when none exists."""
    from moerl.parallel.layout import pipeline_layer_range

    if num_layers % pp_size == 0:
        return (None, None)

    def ok(f, la):
        try:
            sizes = [len(pipeline_layer_range(num_layers, pp_size, r, f, la)) for r in range(pp_size)]
        except ValueError:
            return None
        return sizes

    if (first is not None or last is not None) and ok(first, last):
        return (first, last)
    best, best_key = None, None
    per = math.ceil(num_layers / pp_size)
    for f in range(1, per + 1):
        for la in range(1, per + 1):
            sizes = ok(f, la)
            if sizes is None:
                continue
            key = (max(sizes), la, -f)
            if best_key is None or key < best_key:
                best, best_key = (f, la), key
    return best


def _link(span: int, hw) -> float:
    """GB/s of a group spanning ``span`` consecutive ranks."""
    return hw.nvlink_gbs if span <= hw.gpus_per_node else hw.inter_node_gbs


def estimate_step_time(plan: RecipePlan, cfg) -> dict[str, float]:
    """Seconds of one RL step of ``plan`` (see the module docstring for every formula).

    Returns:
        {"compute", "bubble", "tp", "ep", "pp", "dp", "total"} in seconds, plus "flops" (the step's
        model FLOPs), "fp8_flops" (the part at the FP8 peak) and the comm volumes per GPU in bytes
        ("tp_bytes", "ep_bytes", "pp_bytes", "dp_bytes").

    Raises:
        moerl.config.ConfigError: the GPU's peak BF16 throughput is unknown (hardware.gpu or
            hardware.peak_bf16_tflops not set).
    """
    from moerl.parallel.memory_model import ModelShape, _recipe_vocab_size
    from moerl.pipeline.simulator import published_bubble

    mem, work, hw = plan.memory, plan.workload, plan.hardware
    if hw.bf16_tflops is None:
        from moerl.config.errors import ConfigError

        raise ConfigError("hardware.gpu (or hardware.peak_bf16_tflops) must be set to estimate step times",
                          key="hardware.gpu", hint="set hardware.gpu, e.g. hardware.gpu=H100")
    shape = ModelShape.from_recipe(cfg, _recipe_vocab_size(cfg))
    b = _DTYPE_BYTES[mem.params_dtype]
    h, S = shape.hidden_size, work.sample_tokens
    tp, pp, ep, etp, dp, edp = mem.tp_size, mem.pp_size, mem.ep_size, mem.etp_size, mem.dp_size, mem.expert_dp_size
    sp_div = tp if mem.sequence_parallel else 1
    # FLOPs
    active = total_params(shape)["active"] - shape.vocab_size * h * (0 if shape.tie_word_embeddings else 1)
    if shape.mla is None:
        dqk = dv = shape.head_dim
    else:
        dqk, dv = shape.mla.qk_nope_head_dim + shape.mla.qk_rope_head_dim, shape.mla.v_head_dim
    attn = shape.num_layers * 2 * shape.num_attention_heads * (dqk + dv) * S / 2
    T = work.step_tokens
    fwd, fwd_attn = T * (2 * active + attn), T * attn
    # forward-pass equivalents: old log-probs, update (3), full recompute, reference, critic (values + update)
    full = 1 if mem.recompute == "full" else 0
    updates = 2 if mem.critic else 1
    passes_f = 1 + (1 if mem.reference_policy else 0) + updates * (3 + full) + (1 if mem.critic else 0)
    flops = passes_f * fwd + (updates * fwd_attn if mem.recompute == "selective" else 0.0)
    # FP8 (precision.fp8, Transformer Engine): the transformer layers' GEMMs at the FP8 peak, except the
    # layers kept in BF16; attention's core, the output layer and everything else at the BF16 peak
    fp8_flops = 0.0
    prec = getattr(cfg, "precision", None)
    if prec is not None and getattr(prec, "fp8", None) and hw.fp8_tflops:
        bf16_layers = prec.fp8_bf16_first_layers + prec.fp8_bf16_last_layers
        layer_mm = active - shape.vocab_size * h  # the output layer stays BF16
        fp8_flops = passes_f * T * 2 * layer_mm * max(0, shape.num_layers - bf16_layers) / shape.num_layers
    rate = mem.world_size * 1e12 * hw.mfu
    compute = (flops - fp8_flops) / (hw.bf16_tflops * rate) + (fp8_flops / (hw.fp8_tflops * rate) if fp8_flops else 0.0)
    # pipeline bubble
    m = mem.num_microbatches
    bubble = 0.0
    if pp > 1:
        if mem.pipeline_schedule == "dualpipev":
            bub = published_bubble("dualpipev", 2 * pp, 0.5, 1.0, 0.5)
        else:
            bub = published_bubble(mem.pipeline_schedule, pp, 1.0, 2.0, 1.0)
        bubble = compute * bub / (3.0 * m)
    # comm passes per micro-batch: old log-probs, reference, update (fwd + bwd), recompute, critic
    passes = 1 + (1 if mem.reference_policy else 0) + 2 + (1 if mem.recompute == "full" else 0)
    if mem.critic:
        passes += 3 + (1 if mem.recompute == "full" else 0)
    tmb = work.seq_length * work.micro_batch_size
    layers = max(st.layers for st in mem.stages)
    busiest = max(mem.stages, key=lambda st: st.layers)
    moe_layers = round(layers * sum(shape.moe_layers) / shape.num_layers)
    tp_bytes = passes * m * layers * 4 * (tp - 1) / tp * tmb * h * b if tp > 1 else 0.0
    tp_s = tp_bytes / (_link(tp, hw) * 1e9)
    ep_bytes = passes * m * moe_layers * 2 * shape.num_experts_per_tok * (tmb / sp_div) * h * b * (ep - 1) / ep
    span = etp * ep
    local = min(span, hw.gpus_per_node) // etp  # EP peers in my node, me included
    inter_share = (ep - local) / (ep - 1) if ep > 1 else 0.0
    ep_s = ep_bytes * ((1 - inter_share) / (hw.nvlink_gbs * 1e9) + inter_share / (hw.inter_node_gbs * 1e9))
    pp_bytes = passes * m * (tmb / sp_div) * h * b * (2 if mem.pipeline_schedule != "1f1b" else 1) if pp > 1 else 0.0
    pp_s = pp_bytes / (_link(mem.world_size, hw) * 1e9)
    per_param = (4 + b) if mem.use_distributed_optimizer else 8
    models = 2 if mem.critic else 1
    dense_bytes = models * per_param * (dp - 1) / dp * busiest.params_dense if dp > 1 else 0.0
    expert_bytes = models * per_param * (edp - 1) / edp * busiest.params_expert if edp > 1 else 0.0
    dp_s = dense_bytes / (_link(tp * dp, hw) * 1e9) + expert_bytes / (_link(etp * ep * edp, hw) * 1e9)
    total = compute + bubble + tp_s + ep_s + pp_s + dp_s
    return {"compute": compute, "bubble": bubble, "tp": tp_s, "ep": ep_s, "pp": pp_s, "dp": dp_s, "total": total,
            "flops": flops, "fp8_flops": fp8_flops, "tp_bytes": tp_bytes, "ep_bytes": ep_bytes, "pp_bytes": pp_bytes,
            "dp_bytes": dense_bytes + expert_bytes}


@dataclass
class Candidate:
    """One valid layout: its settings, its plan, peak bytes per GPU and estimated step time.

    ``fits``: the training side (the busiest pipeline rank) fits; the colocated rollout engines do not
    depend on the layout (SearchResult.rollout_fits). ``overrides``: the ``key=value`` overrides that turn
    the recipe into this layout (only the keys that differ from the recipe; ``train.pack=false`` for
    DualPipe(V)), printed by ``format_search`` so that ``moerl plan RECIPE <overrides>`` reproduces it.
    """

    layout: dict[str, Any]
    plan: RecipePlan
    peak: float
    fits: bool
    time: dict[str, float]
    overrides: list[str] = field(default_factory=list)

    def label(self) -> str:
        """One-line description, e.g. ``tp 4 pp 16 ep 4 etp 4 dp 4 recompute full 1f1b (first 3, last 2 layers)``."""
        lay = self.layout
        s = (f"tp {lay['tp_size']} pp {lay['pp_size']} ep {lay['ep_size']} etp {lay['etp_size']} "
             f"dp {self.plan.memory.dp_size} recompute {lay['recompute']}")
        if lay["pp_size"] > 1:
            s += f" {lay['pipeline_schedule']}"
            if lay.get("num_layers_in_first_pipeline_stage") or lay.get("num_layers_in_last_pipeline_stage"):
                s += (f" (first {lay.get('num_layers_in_first_pipeline_stage')}, "
                      f"last {lay.get('num_layers_in_last_pipeline_stage')} layers)")
        return s


@dataclass
class SearchResult:
    """``search_layouts``' answer: the layouts that fit, fastest first, and what was looked at."""

    world_size: int
    valid: int
    rejected: int
    fitting: list[Candidate] = field(default_factory=list)
    closest: list[Candidate] = field(default_factory=list)  # the smallest peaks when nothing fits
    mfu: float = 0.0
    gpu: str = ""
    usable: float = 0.0
    current: Optional[Candidate] = None  # the recipe's own layout when it is valid at world_size
    rollout_fits: Optional[bool] = None  # colocated engines' KV cache (same at every layout); None: not colocated

    @property
    def fitting_everything(self) -> list[Candidate]:
        """The layouts whose training side fits and whose colocated rollout engines (if any) fit."""
        return [] if self.rollout_fits is False else self.fitting

    def to_dict(self, top: int = 5) -> dict[str, Any]:
        """JSON-safe summary of the ``top`` fitting layouts (or the closest ones)."""
        rows = self.fitting[:top] or self.closest[:top]
        return {"world_size": self.world_size, "valid_layouts": self.valid, "rejected_layouts": self.rejected,
                "fitting_layouts": len(self.fitting), "rollout_fits": self.rollout_fits,
                "fitting_layouts_with_rollout": len(self.fitting_everything), "gpu": self.gpu,
                "usable_gib": self.usable / GIB, "mfu": self.mfu,
                "layouts": [{"layout": c.layout, "dp_size": c.plan.memory.dp_size, "peak_gib": c.peak / GIB,
                             "fits": c.fits, "step_time_s": c.time, "overrides": " ".join(c.overrides)}
                            for c in rows]}


def search_layouts(cfg, world_size: int, seq_length: Optional[int] = None,
                   flash_attention: bool = True) -> SearchResult:
    """Enumerate, validate, plan and rank the layouts of ``cfg`` on ``world_size`` GPUs (module docstring).

    Raises:
        moerl.config.ConfigError: no GPU memory or peak throughput known (hardware.gpu), a bad
            --seq-length / hardware.max_prompt_tokens, or no layout of the recipe tiles world_size.
    """
    from moerl.config.errors import ConfigError
    from moerl.config.schema import RecipeConfig
    from moerl.errors import CLIError
    from moerl.parallel.memory_model import check_fp8_gpu

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CLIError(f"--world-size must be a positive number of GPUs, got {world_size!r}", key="--world-size",
                       hint="give --world-size N with N >= 1")
    hwc = cfg.hardware
    if hwc.gpu is None and (hwc.gpu_memory_gib is None or hwc.peak_bf16_tflops is None):
        raise ConfigError("--search needs the GPU: hardware.gpu is not set", key="hardware.gpu",
                          hint="set hardware.gpu (e.g. hardware.gpu=H100) or both hardware.gpu_memory_gib and "
                          "hardware.peak_bf16_tflops")
    recipe_workload(cfg, 1, seq_length)  # a bad --seq-length / hardware.max_prompt_tokens fails here, once
    check_fp8_gpu(cfg)  # precision.fp8 on a GPU without FP8: refused once, not as every layout
    base = cfg.to_dict()
    hf = cfg.model.hf_config
    p0 = cfg.parallel
    result = SearchResult(world_size, 0, 0)
    first_error: Optional[str] = None
    for tp in [d for d in _divisors(world_size) if d <= hwc.gpus_per_node]:
        for pp in [d for d in _divisors(world_size // tp) if d <= hf.num_hidden_layers]:
            split = pipeline_split(hf.num_hidden_layers, pp, p0.num_layers_in_first_pipeline_stage,
                                   p0.num_layers_in_last_pipeline_stage) if pp > 1 else (None, None)
            if split is None:
                continue
            for etp in sorted({1, tp}):
                for ep in [d for d in _divisors(hf.num_experts) if (world_size // pp) % (etp * d) == 0]:
                    for sched in SCHEDULES if pp > 1 else ("1f1b",):
                        for rec in RECOMPUTES:
                            layout = dict(tp_size=tp, pp_size=pp, ep_size=ep, etp_size=etp, recompute=rec,
                                          num_layers_in_first_pipeline_stage=split[0],
                                          num_layers_in_last_pipeline_stage=split[1], pipeline_schedule=sched)
                            d = {**base, "parallel": {**base["parallel"], "world_size": world_size,
                                                      **{k: v for k, v in layout.items() if k != "pipeline_schedule"}},
                                 "train": {**base["train"], "pipeline_schedule": sched}}
                            if sched != "1f1b":
                                d["train"]["pack"] = False
                            overrides = _overrides(base, d)
                            try:
                                cand = RecipeConfig.model_validate(d)
                                cand.check_world_size(world_size, trainable=False)
                                plan = plan_recipe(cand, world_size, seq_length, flash_attention)
                            except ValueError as e:  # pydantic's ValidationError and ConfigError are ValueErrors
                                result.rejected += 1
                                first_error = first_error or str(e)
                                continue
                            result.valid += 1
                            peak = plan.memory.worst().total(rec)
                            usable = plan.hardware.usable_bytes
                            c = Candidate(layout, plan, peak, peak <= usable, estimate_step_time(plan, cand), overrides)
                            if plan.rollout is not None:
                                result.rollout_fits = bool(plan.rollout.fits)
                            if c.fits:
                                result.fitting.append(c)
                            else:
                                result.closest.append(c)
                            same = (tp == p0.tp_size and pp == p0.pp_size and ep == p0.ep_size
                                    and etp == p0.expert_tp_size and rec == p0.recompute
                                    and sched == (cfg.train.pipeline_schedule if pp > 1 else "1f1b"))
                            if same:
                                result.current = c
                            result.mfu, result.gpu, result.usable = plan.hardware.mfu, plan.hardware.name, usable
    if result.valid == 0:
        raise CLIError(f"--world-size {world_size}: no layout of this recipe tiles {world_size} GPUs (tp <= "
                       f"hardware.gpus_per_node {hwc.gpus_per_node}, pp dividing the layers, ep dividing "
                       f"model.hf_config.num_experts {hf.num_experts}, batch sizes divisible by dp); e.g. "
                       f"{first_error.splitlines()[-1].strip() if first_error else ''}", key="--world-size",
                       hint="pick a --world-size that is a multiple of the GPUs per node and divides "
                       "train.global_batch_size's data-parallel split")
    result.fitting.sort(key=lambda c: c.time["total"])
    result.closest.sort(key=lambda c: c.peak)
    return result


def _override_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _overrides(base: dict[str, Any], cand: dict[str, Any]) -> list[str]:
    """``section.key=value`` for every parallel.* / train.* key that ``cand`` changes in ``base``."""
    out = []
    for section in ("parallel", "train"):
        for k, v in cand[section].items():
            if base[section].get(k) != v:
                out.append(f"{section}.{k}={_override_value(v)}")
    return out


def format_search(result: SearchResult, top: int = 5, title: str = "") -> str:
    """The ``top`` fitting layouts, fastest first, with peak memory, the step-time parts and, per layout, the
    overrides that reproduce it (``moerl plan RECIPE <overrides>``)."""
    n = len(result.fitting)
    if result.rollout_fits is None:
        fit = f"{n} fit"
    elif result.rollout_fits:
        fit = f"{n} fit (trainer, and the colocated rollout engines fit at every layout)"
    else:
        fit = (f"{n} fit the trainer's memory but NONE fits as a whole: the colocated rollout engines' KV cache "
               "DOES NOT FIT at any layout (last line)")
    lines = [f"moerl plan --search{': ' + title if title else ''}",
             f"{result.world_size} x {result.gpu} ({result.usable / GIB:.1f} GiB usable each): {result.valid} valid "
             f"layouts ({result.rejected} refused by the recipe rules), {fit}",
             f"step time = compute at MFU {result.mfu:g} (hardware.mfu) x (1 + pipeline bubble) + TP + EP + PP + DP "
             "communication, not overlapped (formulas: moerl/parallel/plan_search.py)"]
    every = result.fitting + result.closest
    if every and every[0].time.get("fp8_flops"):
        t = every[0].time
        lines.append(f"precision.fp8 {every[0].plan.fp8}: {t['fp8_flops'] / t['flops']:.0%} of the FLOPs at the "
                     "GPU's FP8 peak")
    if every:
        from moerl.parallel.memory_model import recipe_vocab_is_default

        p0 = every[0].plan
        if recipe_vocab_is_default(p0.vocab_source):
            lines.append(f"WARNING: vocab {p0.vocab_size} from {p0.vocab_source}")
    if result.current is not None:
        c = result.current
        lines.append(f"the recipe's layout ({c.label()}): peak {c.peak / GIB:.2f} GiB, "
                     + ("FITS" if c.fits else "DOES NOT FIT") + f", {c.time['total']:.1f} s/step")
    rows = result.fitting[:top]
    if not rows:
        lines.append("no layout fits; the smallest peaks:")
        rows = result.closest[:top]
    lines.append(f"{'#':>2} {'layout':<62} {'peak GiB':>8} {'free GiB':>8} {'step s':>7} | compute bubble     tp     ep"
                 "     pp     dp")
    for i, c in enumerate(rows, 1):
        t = c.time
        lines.append(f"{i:>2} {c.label():<62} {c.peak / GIB:8.2f} {(result.usable - c.peak) / GIB:8.2f} "
                     f"{t['total']:7.1f} | {t['compute']:7.1f} "
                     f"{t['bubble']:6.1f} {t['tp']:6.1f} {t['ep']:6.1f} {t['pp']:6.1f} {t['dp']:6.1f}")
        lines.append(f"   overrides: {' '.join(c.overrides) or '(the recipe as it is)'}")
    r = rows[0].plan if rows else None
    if r is not None and r.rollout is not None:
        ro = r.rollout
        lines.append(f"colocated rollout engines (same for every layout): KV pool {ro.kv_pool / GIB:.2f} GiB per GPU "
                     f"for {ro.kv_needed / GIB:.2f} GiB of KV cache: " + ("FITS" if ro.fits else
                                                                          f"DOES NOT FIT (holds {ro.sequences_held} of "
                                                                          f"{ro.sequences} sequences)"))
    return "\n".join(lines)
