"""The page ``make bench`` writes (``benchmarks/run.py``): docs/benchmarks.md's tables and its chart, from the
report the runs gathered."""

from __future__ import annotations

import math
import statistics
from pathlib import Path


def _eval_steps(steps: int) -> int:
    """The fewest evaluation steps a worker times for ``--steps`` training steps."""
    return max(3, steps // 4)


def _median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def _timing_key(impl: str, runtime: str) -> str:
    """The key of one implementation's timing: ``ort@<runtime>`` for ort_trainer, else its name."""
    return f"{impl}@{runtime}" if impl == "ort" else impl


RUNTIME_NAMES = {"current": "today's onnxruntime", "legacy": "1.19.2 training build"}


def _medians(result: dict, kind: str) -> dict[str, float]:
    return {impl: _median_ms(times) for impl, times in result.get(kind, {}).items() if times}


def _median_of(timing: dict, key: str, kind: str) -> float | None:
    times = timing.get(key, {}).get(kind)
    return _median_ms(times) if times else None


def _build_seconds(result: dict) -> float:
    return result.get("first_step_s", float("nan")) - result.get("step_s", 0)


def _ratio(numerator: float | None, denominator: float | None) -> float:
    return numerator / denominator if numerator and denominator else float("nan")


def _describe(report: dict, runtime: str) -> tuple[str, str]:
    """The runtime distribution and gradient source that a timing worker of ``runtime`` reported."""
    for timing in report["timing"].values():
        record = timing.get(_timing_key("ort", runtime), {})
        if record.get("runtime"):
            return record["runtime"], record.get("gradient_source", "?")
    return "?", "?"


def _load(values) -> str:
    return " / ".join(f"{value:.2f}" for value in values) if values else "not recorded"


def _timed_for(report: dict) -> str:
    """How long each worker timed, as the report's settings say (empty for a report without them)."""
    settings = report.get("timing_settings")
    if not settings:
        return ""
    return (f" (training steps: at least {settings['steps']} and for at least {settings['min_seconds']:g} s; "
            f"then evaluation steps: at least {_eval_steps(settings['steps'])} and for at least "
            f"{settings['min_seconds']:g} s)")


def _ms(value: float) -> str:
    """A time in ms with two significant decimals below 10 ms (a 0.3 / 0.4 ms comparison says little)."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def write_report(report: dict, out: Path) -> None:
    """Write the markdown tables (a row per model per runtime) and the PNG chart.

    Args:
        report: ``{"machine": str, "load_before"/"load_after": (1, 5, 15 min load averages),
            "timing": {model: {"ort@<runtime>" | "eager" | "compile": {"train": [s], "eval": [s],
            "round_medians_ms": [ms], "round_other_cores": [cores], "errors": [str], "runtime": str,
            "gradient_source": str}}},
            "runtimes": {runtime: {model: {"build_cold", "build_cached", "rss", ["ablation"]}}}}``.
        out: the markdown file; the chart goes beside it with the suffix ``.png``.
    """
    runtimes, timings = report["runtimes"], report["timing"]
    lines = ["# Benchmarks", "", f"Machine: {report['machine']}; load average (1 / 5 / 15 min) "
             f"{_load(report.get('load_before'))} at the start, {_load(report.get('load_after'))} at the end.", ""]
    for runtime in runtimes:
        description, source = _describe(report, runtime)
        lines.append(f"- **{runtime}** ({RUNTIME_NAMES.get(runtime, runtime)}): {description}, "
                     f"gradient source `{source}`.")
    lines += ["",
              "Written by `make bench` (`benchmarks/run.py`). Timing: each implementation in its own process, "
              "alternating rounds; both runtimes against the same eager/compile measurement. A round starts a "
              "fresh process per implementation (ort_trainer on each runtime, eager, torch.compile; the order "
              f"reversed every other round), which warms up, then times its steps{_timed_for(report)}; a time is "
              "the median over every timed step of every round. Speed-up = PyTorch time / ort_trainer time "
              "(> 1: ort_trainer is faster). RSS = peak resident memory of a process training that model.", "",
              "## Training step", "",
              "| model | runtime | ort_trainer ms | eager ms | torch.compile ms | vs eager | vs compile | "
              "RSS ort / eager MB | RSS ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    chart: dict = {}
    model_names = list(dict.fromkeys([*timings, *(m for models in runtimes.values() for m in models)]))
    for model in model_names:
        timing = timings.get(model, {})
        eager, comp = _median_of(timing, "eager", "train"), _median_of(timing, "compile", "train")
        comp_cell = _ms(comp) if comp else f"failed: {timing['compile']['errors']}" if "compile" in timing \
            else "not run"
        for runtime, models in runtimes.items():
            if model not in models:
                continue
            key = _timing_key("ort", runtime)
            ort = _median_of(timing, key, "train")
            if ort is None or eager is None:
                errors = {name: timing.get(name, {}).get("errors", "not run") for name in (key, "eager")}
                lines.append(f"| {model} | {runtime} | failed: {errors} | | | | | | |")
                continue
            rss = {impl: value.get("peak_rss_mb") or 0 for impl, value in models[model].get("rss", {}).items()}
            lines.append(
                f"| {model} | {runtime} | {_ms(ort)} | {_ms(eager)} | {comp_cell} | {eager / ort:.2f}× | "
                f"{_ratio(comp, ort):.2f}× | {rss.get('ort', 0):.0f} / {rss.get('eager', 0):.0f} | "
                f"{_ratio(rss.get('ort'), rss.get('eager')):.2f} |")
            chart.setdefault(model, {"eager": 1.0})[f"ort_trainer ({runtime})"] = ort / eager
            if comp:
                chart[model]["torch.compile"] = comp / eager
    lines += ["", "## Evaluation step", "", "| model | runtime | eval_step ms | eager no_grad ms | speed-up |",
              "|---|---|---|---|---|"]
    for model in model_names:
        timing = timings.get(model, {})
        eager = _median_of(timing, "eager", "eval")
        for runtime, models in runtimes.items():
            ort = _median_of(timing, _timing_key("ort", runtime), "eval")
            if model in models and ort and eager:
                lines.append(f"| {model} | {runtime} | {_ms(ort)} | {_ms(eager)} | {eager / ort:.2f}× |")
    lines += ["", "## Timing rounds", "",
              "The median training step of each round, in ms, in the order the rounds ran; in brackets the cores "
              "that other processes kept busy meanwhile (on 2 cores, eager PyTorch's OpenMP threads slow down "
              "many times over when another process takes a core).", "",
              "| model | implementation | round medians ms (other processes' cores) |", "|---|---|---|"]
    for model in model_names:
        for key, record in timings.get(model, {}).items():
            others = record.get("round_other_cores") or [None] * len(record.get("round_medians_ms", []))
            cell = ", ".join(_ms(value) + (f" ({busy:.2f})" if busy is not None else "")
                             for value, busy in zip(record.get("round_medians_ms", []), others))
            if record.get("errors"):
                cell += f" (failed rounds: {record['errors']})"
            lines.append(f"| {model} | {key} | {cell} |")
    lines += ["", "## Graph build", "",
              "| model | runtime | first step, empty cache (s) | first step, graph from the cache (s) |",
              "|---|---|---|---|"]
    for model in model_names:
        for runtime, models in runtimes.items():
            if model in models:
                entry = models[model]
                lines.append(f"| {model} | {runtime} | {_build_seconds(entry['build_cold']):.2f} | "
                             f"{_build_seconds(entry['build_cached']):.2f} |")
    lines += ["", "## Targets", "",
              "Today's runtime against 1.19.2: both ort_trainer processes against the one eager measurement.", "",
              "| target | measured | met? |", "|---|---|---|"]
    current = runtimes.get("current", {})
    for model in model_names:
        entry = current.get(model)
        if entry is None:
            continue
        timing = timings.get(model, {})
        ort, eager = _median_of(timing, "ort@current", "train"), _median_of(timing, "eager", "train")
        rss = {impl: value.get("peak_rss_mb") or 0 for impl, value in entry.get("rss", {}).items()}
        speed = _ratio(eager, ort)
        checks = []
        if model in runtimes.get("legacy", {}):
            old_speed = _ratio(eager, _median_of(timing, "ort@legacy", "train"))
            checks.append((f"{model}: step vs eager on today's runtime ≥ on 1.19.2 ({old_speed:.2f}×)", speed,
                           old_speed, True))
        compiled = _median_of(timing, "compile", "train")
        if compiled:
            checks.append((f"{model}: step ≥ 1.0× torch.compile", _ratio(compiled, ort), 1.0, True))
        checks += [(f"{model}: step ≥ 1.3× eager", speed, 1.3, True),
                   (f"{model}: eval_step ≥ 1.3× eager no_grad",
                    _ratio(_median_of(timing, "eager", "eval"), _median_of(timing, "ort@current", "eval")), 1.3,
                    True),
                   (f"{model}: peak RSS ≤ 1.0× eager", _ratio(rss.get("ort"), rss.get("eager")), 1.0, False)]
        for label, value, bound, higher in checks:
            met = value >= bound if higher else value <= bound
            verdict = "not measured" if math.isnan(value) or math.isnan(bound) else "yes" if met else \
                f"no, by {abs(value - bound) / bound:.0%}"
            lines.append(f"| {label} | {value:.2f}× | {verdict} |")
        if model == "bert":
            cold, warm = _build_seconds(entry["build_cold"]), _build_seconds(entry["build_cached"])
            lines.append(f"| bert: first graph build < 10 s | {cold:.2f} s | {'yes' if cold < 10 else 'no'} |")
            lines.append(f"| bert: graph from the cache < 1 s | {warm:.2f} s | {'yes' if warm < 1 else 'no'} |")
    lines += ["", "Why the missed targets are missed, with the profiles: `docs/performance.md`."]
    if any("ablation" in entry for models in runtimes.values() for entry in models.values()):
        lines += ["", "## Graph optimisations", "",
                  "Each row: the step time with every optimisation on, and with that one turned off "
                  "(`graph_optimizations.<name>: false`; for `fused_optimizer`, `graph.optimizer: \"graph\"`: the "
                  "double-buffered ONNX optimizer graph), alternating in one process per runtime: both sides "
                  "are ONNX Runtime, so the spinning of its intra-op threads taxes both alike.", "",
                  "| model | runtime | optimisation | all on ms | without it ms | its effect |",
                  "|---|---|---|---|---|---|"]
        for model in model_names:
            for runtime, models in runtimes.items():
                for name, result in models.get(model, {}).get("ablation", {}).items():
                    train = _medians(result, "train")
                    if "ort" not in train or f"ort_without:{name}" not in train:
                        lines.append(f"| {model} | {runtime} | {name} | | | failed: "
                                     f"{result.get('error', result.get('errors'))} |")
                        continue
                    on, off = train["ort"], train[f"ort_without:{name}"]
                    lines.append(f"| {model} | {runtime} | {name} | {_ms(on)} | {_ms(off)} | {off / on:.2f}× |")
    out.write_text("\n".join(lines) + "\n")
    _chart(chart, out.with_suffix(".png"))
    print("\n".join(lines))


def _chart(chart: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(chart)
    impls = list(dict.fromkeys(impl for values in chart.values() for impl in values))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        values = [chart[m].get(impl, 0) for m in models]
        ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in range(len(models))], values, width, label=impl)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("training step time / eager")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title("Training step time relative to PyTorch eager (lower is faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
