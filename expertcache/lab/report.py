"""Write a study's markdown report and plots (matplotlib PNG)."""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from ..atomic import write_text
from ..jsonout import dump_json
from .plots import scatter
from .study import BASELINE, FEW_WINDOWS, StudyResult, increase_text


def _ci(r: dict) -> str:
    return increase_text(r)


def _r(x) -> str:
    """A correlation, or why there is none (fewer than 3 points, or one without spread)."""
    return f"{x:.3f}" if x is not None and math.isfinite(x) else \
        "undefined (fewer than 3 points, or no spread among them)"


def write_report(res: StudyResult, out: Path) -> list[Path]:
    """Write the study's README.md (tables and findings), study.json and plots into `out`; returns the
    files written. They are made in a folder of their own inside `out` and moved in together at the end: a run
    interrupted (or a disk full) while they were written one by one left a new study.json beside an earlier run's
    README and plots."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".study.", suffix=".partial", dir=out))
    try:
        written = _write_files(res, staging)
        for f in written:
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / f.name for f in written]


def _write_files(res: StudyResult, out: Path) -> list[Path]:
    dump_json(out / "study.json", res.to_dict())
    plots = _plots(res, out)
    s, a = res.sequences, res.analyses
    numbered = iter(range(1, 10))
    section = lambda title: f"## {next(numbered)}. {title}"  # noqa: E731 -- numbered as they appear
    lines = [f"# Emulation study: {Path(res.model).name}", "",
             f"{s['tokens']} teacher-forced tokens of "
             f"{'the evaluation text' if res.config.get('text') is None else Path(res.config['text']).name} "
             f"({', '.join(s['domains'])}), "
             f"windows of {res.config['context']}, cache {s['slots_per_layer']}/{s['experts']} experts per layer "
             f"(fraction {res.config['cache_fraction']}), warm start, `ram` store (exact). Perplexity increase is over "
             "fetch-every-miss on the same windows, with a paired bootstrap 95% CI over windows (Student's t from "
             f"fewer than {FEW_WINDOWS}).", "",
             ("| policy | ppl | increase [95% CI] | calls subst. | slots subst. | mass/call | hit rate | fetches/token "
              "| admissions + upgrades/token |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for spec, r in res.runs.items():
        lines.append(f"| `{spec}` | {r['ppl']:.2f} | {_ci(r)} | {r['calls_substituted_pct']:.1f}% | "
                     f"{r['slots_substituted_pct']:.1f}% | {r['mass_per_call']:.4f} | {r['hit_rate']:.1%} | "
                     f"{r['sync_fetches_per_token']:.2f} | {r['admissions_per_token']:.3f} |")
    if res.not_run:  # the policies an interrupt left out, then the generation test
        policies = ", ".join(f"`{p}`" for p in res.not_run if p != "generation test")
        lines += ["", f"Interrupted (Ctrl-C): not run {policies + ', nor ' if policies else ''}the generation test."]
    if "where_loss_comes_from" in a:
        w = a["where_loss_comes_from"]
        sa, th = w["substitute-all"], w["threshold:tau=0.15"]
        lines += ["", section("Where the loss comes from"), "",
                  f"Substitute-every-miss substituted in {sa['calls_substituted_pct']:.1f}% of calls "
                  f"({sa['slots_substituted_pct']:.1f}% of slots, mass {sa['mass_per_call']:.4f}/call): {_ci(sa)}. "
                  f"The 0.15 rule substituted in {th['calls_substituted_pct']:.1f}% of calls "
                  f"({th['slots_substituted_pct']:.1f}% of slots, mass {th['mass_per_call']:.4f}/call): {_ci(th)}."]
    m = a.get("mass_hypothesis", {})
    lines += ["", section("Mass hypothesis"), "",
              f"Pearson r between substituted mass per call and perplexity increase across the policies that "
              f"always fetch the first choice ({', '.join(f'`{p}`' for p in m.get('policies', []))}): "
              f"**{_r(m.get('r_across_policies'))}**. Across windows for the 0.15 rule: "
              f"r = {_r(m.get('r_across_windows_threshold_0.15'))}.",
              "", "![increase vs mass](mass_vs_increase.png)"]
    if "equal_mass" in a:
        e = a["equal_mass"]
        lines += ["", section("Equal mass, different composition"), "",
                  f"Few heavy (`{e['heavy']['policy']}`: {e['heavy']['slots_substituted_pct']:.1f}% of slots, mass "
                  f"{e['heavy']['mass_per_call']:.4f}/call): {_ci(e['heavy'])}. Many light (`{e['light']['policy']}`: "
                  f"{e['light']['slots_substituted_pct']:.1f}% of slots, mass {e['light']['mass_per_call']:.4f}/call): "
                  f"{_ci(e['light'])}.", "", "| light policy | mass/call | increase |", "|---|---:|---:|"]
        lines += [f"| `{p}` | {r['mass_per_call']:.4f} | {_ci(r)} |" for p, r in e["light_sweep"].items()]
    if "background_admission" in a:
        b = a["background_admission"]
        lines += ["", section("Background admission"), "",
                  f"quality-first against the same without admission (beta 0): overall {_ci(b['overall'])}; "
                  f"in the first two windows after each topic change {_ci(b['after_topic_change'])} "
                  f"({b['admissions_per_token']:.3f} admissions per token). Negative is better."]
    g = res.generation
    if g:
        lines += ["", section("Generation test"), "",
                  f"Greedy continuations ({res.config['new_tokens']} tokens) of {s['prompts']} prompts from every "
                  "domain, against fetch-every-miss.", "",
                  "| policy | identical tokens | mean first divergence | r(mass, disagreement) |",
                  "|---|---:|---:|---:|"]
        for spec, r in g.items():
            if spec in ("samples", "prompt0"):
                continue
            lines.append(f"| `{spec}` | {r['identical_token_share']:.1%} | {r['mean_first_divergence']:.1f} | "
                         f"{_r(r['r_mass_vs_disagreement'])} |")
    lines += ["", "![pareto](pareto.png)", "", "![bytes fetched](bytes.png)", ""]
    write_text(out / "README.md", "\n".join(lines))  # whole or not at all, as the plots beside it
    return [out / "README.md", out / "study.json", *plots]


def _plots(res: StudyResult, out: Path) -> list[Path]:
    runs = {p: r for p, r in res.runs.items() if p != BASELINE}
    ci = {p: (r["pct"] - r["ci"][0], r["ci"][1] - r["pct"]) for p, r in res.runs.items() if r.get("ci")}
    short = {p: p.replace("threshold:", "").replace("band:", "") for p in res.runs}
    return [
        scatter({p: (r["mass_per_call"], r["pct"]) for p, r in runs.items()}, "substituted gate mass per MoE call",
                "perplexity increase (%)", "Perplexity increase vs substituted mass", out / "mass_vs_increase.png",
                ci, short=short),
        scatter({p: (r["sync_fetches_per_token"], r["pct"]) for p, r in res.runs.items()},
                "synchronous fetches per token", "perplexity increase (%)",
                "Quality vs fetches (lower left is better)", out / "pareto.png", ci, frontier=True, short=short),
        scatter({p: (r["fetched_kib_per_token"], r["pct"]) for p, r in res.runs.items()},
                "KiB fetched per token (every transfer and precision)", "perplexity increase (%)",
                "Quality vs bytes fetched (lower left is better)", out / "bytes.png", ci, frontier=True, short=short)]
