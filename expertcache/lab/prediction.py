"""Measuring and training the next-layer predictors on recorded layer states.

`record_states` runs the exact model over a text and keeps, per layer l, the residual after
attention r_l, the normed MoE input x_l, the routed experts (ids, weights) and the router
logits (and, asked for, the experts' sketches fitted on what they computed). Transition
l -> l+1 pairs the first four at l, and the previous token's experts at l+1, with the logits
at l+1.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..engine.checkpoint import ESTIMATOR_FILE, LOOKAHEAD_FILE, check_writable, load_default_vectors, open_checkpoint
from ..engine.experts import ExpertKind
from ..engine.moe import router_logits
from ..engine.predictors import (
    LOOKAHEAD_WIDTH,
    PREDICTORS,
    SKETCH_NEURONS,
    SKETCH_RANK,
    Estimator,
    EstimatorNet,
    ExpertSketch,
    Lookahead,
    Predictor,
    QuasiHidden,
    check_predictor_files,
    load_estimator,
    make_predictor,
    run_ahead,
    save_estimator,
)
from ..engine.transformer import Transformer
from ..errors import BadInput
from ..kernel.routing import Router
from ..models import model_args
from .calibrate import RecordingMoE, check_fit_tokens, run_exact


@dataclass
class LayerStates:
    """Per layer l, every recorded token's residual r_l and MoE input x_l [N, H], routed ids and weights
    [N, k] and router logits [N, E]; `starts` [N]: the tokens that begin a window (no previous token); `pre`
    (recorded when asked for): per layer, its decoder layer's input before attention [N, H]."""
    resid: list[torch.Tensor]  # per layer [N, H]
    x: list[torch.Tensor]
    ids: list[torch.Tensor]  # [N, k]
    weights: list[torch.Tensor]
    logits: list[torch.Tensor]  # [N, E]
    starts: torch.Tensor  # [N] bool
    pre: list[torch.Tensor] | None = None
    ahead: list[torch.Tensor] | None = None  # per transition l -> l+1, the lookahead's inputs [N, H] (add_lookahead)
    sketch: ExpertSketch | None = None  # the source layers' expert sketches, fitted while recording (`sketch`)

    def previous(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's previous token's routed ids and weights at `layer` [N, k] (weight 0 at a window's start),
        as a decoding engine knows them."""
        ids, weights = self.ids[layer].roll(1, 0), self.weights[layer].roll(1, 0).clone()
        weights[self.starts] = 0
        return ids, weights


class _Recorder(RecordingMoE):
    def __init__(self, ckpt, args, router, kind, pre: bool, sketch: tuple[int, int] | None):
        super().__init__(ckpt, args, router, kind)
        self.resid_now, self.pre, self.sketch_size = None, pre, sketch
        if sketch is not None:  # the sketches of layers 0..L-2, the transitions' sources, filled as experts run
            L, E = args.num_moe_layers - 1, args.num_experts
            self.sketch = [torch.zeros(L, E, *shape) for shape in ExpertSketch.shapes(args.hidden_size, *sketch)]
        self.rows = [dict(resid=[], x=[], ids=[], weights=[], logits=[], pre=[]) for _ in range(args.num_moe_layers)]
        self.moe_index = {i: j for j, i in enumerate(args.moe_layers)}

    def hook(self, layer, h):
        self.resid_now = h

    def seen(self, layer, expert, x, y, parts):
        super().seen(layer, expert, x, y, parts)
        if self.sketch_size is not None and layer < self.args.num_moe_layers - 1:
            for array, fitted in zip(self.sketch, ExpertSketch.fit(x, y, parts, self.kind, *self.sketch_size)):
                array[layer, expert] = fitted

    def before_attention(self, layer, windows):
        if self.pre and layer in self.moe_index:
            self.rows[self.moe_index[layer]]["pre"].append(torch.cat(windows))

    def __call__(self, layer, x, router):
        logits = router_logits(x, router, self.router)  # recorded without the router's bias, as traces hold them
        routing = self.router.route(logits.cpu().numpy(), layer)
        w, ids = torch.from_numpy(routing.weights), torch.from_numpy(routing.ids)
        r = self.rows[layer]
        for key, val in (("resid", self.resid_now), ("x", x), ("ids", ids), ("weights", w), ("logits", logits)):
            r[key].append(val.clone())
        return super().__call__(layer, x, router)


def record_states(model_path: Path, ids: list[int], context: int = 512,
                  progress: Callable[[int], None] | None = None, pre: bool = False,
                  sketch: tuple[int, int] | None = None) -> tuple[Transformer, LayerStates]:
    """Run the exact model over `ids` in windows of `context`, recording every layer's states (run_exact's
    `progress`); with `pre`, each layer's input before attention too (what add_lookahead needs); with `sketch`
    (rank, neurons), the experts' sketches of that size fitted on the tokens routed to them."""
    model, rec, lengths = run_exact(model_path, ids, lambda ckpt, a, router: _Recorder(
        ckpt, a, router, ExpertKind.of(a), pre, sketch), context, progress)
    cat = lambda key: [torch.cat(r[key]) for r in rec.rows]  # noqa: E731
    starts = torch.cat([torch.arange(n) == 0 for n in lengths])  # each window's first token
    return model, LayerStates(cat("resid"), cat("x"), cat("ids"), cat("weights"), cat("logits"), starts,
                              cat("pre") if pre else None,
                              sketch=None if sketch is None else ExpertSketch(*rec.sketch, kind=rec.kind))


@torch.inference_mode()
def add_lookahead(model: Transformer, s: LayerStates, sketch: ExpertSketch,
                  progress: Callable[[int], None] | None = None) -> None:
    """s.ahead: per transition l -> l+1, the lookahead's input for every recorded token as decode computes it:
    layer l+1's attention run ahead on the token's r_l + s_l (its experts' sketches) against the exact keys and
    values of the tokens before it in its window. Each window's exact keys are written first (from s.pre), then
    its tokens run from the last to the first, so that the key each one writes at its own position is past every
    later query's reach. `progress(tokens)` after each window of each transition."""
    a = model.args
    bounds = [*s.starts.nonzero().flatten().tolist(), len(s.starts)]
    s.ahead = []
    for l in range(len(s.x) - 1):
        i = a.moe_layers[l + 1]
        rows = [None] * len(s.starts)
        h = s.resid[l] + sketch.estimate(l, s.x[l], s.ids[l], s.weights[l]).to(s.resid[l].dtype)  # every token's
        for start, end in zip(bounds[:-1], bounds[1:]):
            if i not in model.linear:
                model.attention_block(i, s.pre[l + 1][start:end].clone(), 0)
            for t in reversed(range(start, end)):
                model.position = t - start
                rows[t] = run_ahead(model, l, h[t:t + 1])
            if progress:
                progress(end - start)
        s.ahead.append(torch.cat(rows))
    model.position = None


def _predicted(p: Predictor, s: LayerStates, layer: int, sl: slice) -> torch.Tensor:
    """`p`'s logits for layer+1 [n, E] of the recorded tokens `sl`, from layer `layer`'s states as decode gives them."""
    prev_ids, prev_weights = s.previous(layer + 1)
    prev = (prev_ids[sl], prev_weights[sl])
    if isinstance(p, Lookahead):  # its attention runs ahead per window: the inputs add_lookahead recorded
        pred = p.net_logits(layer, s.ahead[layer][sl], prev)
    else:
        pred = p.logits(layer, s.resid[layer][sl], s.x[layer][sl], s.ids[layer][sl], s.weights[layer][sl], prev)
    assert pred.shape == s.logits[layer + 1][sl].shape, \
        f"{p.name} gave logits {tuple(pred.shape)}, expected {tuple(s.logits[layer + 1][sl].shape)}"
    return pred


def recall_per_layer(p: Predictor, s: LayerStates, top_k: int) -> list[float]:
    """recall@k of transition l -> l+1 for l = 0..L-2: share of the true top-k (routed by the family's router
    when recorded) that was predicted (`predicted_routes`: routed as the model routes)."""
    ids, _ = predicted_routes(p, s)
    out = []
    for layer in range(1, len(s.x)):
        pred, true = ids[layer, :, :top_k], s.ids[layer][:, :top_k].numpy()
        out.append(float((pred[:, :, None] == true[:, None, :]).any(-1).mean()))
    return out


@torch.no_grad()
def predicted_routes(p: Predictor, s: LayerStates, batch: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Each recorded token's routes at every MoE layer l >= 1 as `p` predicts them at layer l - 1, routed by the
    model's router: ids and gate weights [L, N, k], layer-major as the replay reads routes (layer 0, which nothing
    predicts: ids -1, weights 0). A decode token's prefetch takes its first `budget` of them."""
    L, N, k = len(s.x), len(s.starts), p.model.args.top_k
    ids, weights = np.full((L, N, k), -1, np.int64), np.zeros((L, N, k), np.float32)
    for layer in range(L - 1):
        for i in range(0, N, batch):
            sl = slice(i, i + batch)
            r = p.model.router.route(_predicted(p, s, layer, sl).float().numpy(), layer + 1)
            ids[layer + 1, sl], weights[layer + 1, sl] = r.ids[:, :k], r.weights[:, :k]
    return ids, weights


def routing_loss(router: Router, pred: torch.Tensor, true: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """How far predicted router logits pred [N, E] are from the true ones true [N, E] in the family's own
    routing terms, the estimator's training loss. softmax: KL(true || predicted) of the softmax over the
    logits plus the router's logit bias `bias` [N, E] (GPT-OSS; None: no bias); shift-invariant, as the
    softmax's ranking and gates are (also where a selection bias is added to the softmax: ERNIE 4.5).
    sigmoid (DeepSeek-V3, GLM-4.5): the scores sigmoid(logit) rank (plus the selection bias, within groups)
    and weigh absolutely, so a shift moves the routing: each expert's binary cross-entropy between the
    predicted and true scores, summed over experts, meaned over tokens; least at pred == true."""
    pred, true = pred.float(), true.float()
    if router.kind == "sigmoid":
        return F.binary_cross_entropy_with_logits(pred, torch.sigmoid(true), reduction="sum") / len(pred)
    if bias is not None:
        pred, true = pred + bias, true + bias
    return F.kl_div(F.log_softmax(pred, -1), F.log_softmax(true, -1), log_target=True, reduction="batchmean")


def train_estimator(model: Transformer, s: LayerStates, default_vectors: torch.Tensor, epochs: int = 30,
                    lr: float = 2e-3, batch: int = 1024, seed: int = 0, unknown_previous: float = 0.1,
                    progress: Callable[[str, int, int], None] | None = None, lookahead: bool = False,
                    width: int = 512) -> EstimatorNet:
    """Distil (q_l, the previous token's experts at l+1) -> Router_{l+1} logits by `routing_loss` under the model's
    router, one net per transition; with `lookahead`, on s.ahead's inputs instead of q_l and on top of layer l+1's
    router on them (the net learns what the router misses; its last layer starts at zero). A share
    `unknown_previous` of each batch is shown without the previous token's experts, as the engine predicts a
    sequence's first token and a decode batch's. `progress(stage, epochs done, epochs in all)` after each epoch,
    the stage naming the net, the transition and its loss. `width`: the nets' hidden width."""
    a, router = model.args, model.router
    qh = QuasiHidden(model, default_vectors)
    torch.manual_seed(seed)
    net = EstimatorNet(a.hidden_size, a.num_experts, a.num_moe_layers - 1, width)
    g = torch.Generator().manual_seed(seed)
    for l, transition in enumerate(net.transitions):
        with torch.no_grad():
            q = (s.ahead[l] if lookahead else qh.quasi_hidden(l, s.resid[l], s.ids[l], s.weights[l])).float()
            prev_ids, prev_weights = s.previous(l + 1)
            prev_ids, prev_weights = prev_ids.long(), prev_weights.float()
            target = s.logits[l + 1].float()
            base = router_logits(q, model.moe_layers[l + 1]["router"], router).float() if lookahead else None
        if lookahead:
            nn.init.zeros_(transition.fc2.weight)
            nn.init.zeros_(transition.fc2.bias)
        # a softmax router's logit bias of the target layer (GPT-OSS); a sigmoid router's is not needed
        bias = torch.from_numpy(router.bias_table(a.num_moe_layers, a.num_experts)[l + 1]) \
            if router.logit_bias else None
        size = min(batch, len(q))
        opt = torch.optim.AdamW(transition.parameters(), lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * (len(q) // size))
        for epoch in range(epochs):
            perm = torch.randperm(len(q), generator=g)
            total = 0.0
            for i in range(0, len(q) - size + 1, size):
                idx = perm[i:i + size]
                known = torch.rand(len(idx), 1, generator=g) >= unknown_previous  # drawn again at every step
                pred = transition(q[idx], prev_ids[idx], prev_weights[idx] * known)
                if base is not None:
                    pred = pred + base[idx]
                loss = routing_loss(router, pred, target[idx], bias)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                total += loss.item()
            if progress:
                stage = "lookahead" if lookahead else "train"
                progress(f"{stage} {l}->{l + 1}, loss {total / (len(q) // size):.4f}", 1, epochs * len(net.transitions))
    return net.eval()


def fit_estimator(model_path: Path, ids: list[int], hybrid_below: float = 0.85, epochs: int = 30,
                  progress: Callable[[str, int, int], None] | None = None,
                  sketch: tuple[int, int] = (SKETCH_RANK, SKETCH_NEURONS), width: int = LOOKAHEAD_WIDTH) -> dict:
    """Train the estimator on calibration tokens, choose the hybrid's layers (quasi-hidden recall
    below `hybrid_below` there) and save it beside the model; then the lookahead's expert sketches of `sketch`'s
    rank and neurons and its net of `width`, saved beside it too. `progress(stage, done, total)`: the tokens
    recorded, the estimator's epochs, the lookahead's inputs (tokens of every transition), its epochs."""
    check_fit_tokens(ids, "predict --train")
    dv = load_default_vectors(model_path)  # before the minutes of recording
    check_writable(model_path, (ESTIMATOR_FILE, LOOKAHEAD_FILE))
    a = model_args(open_checkpoint(model_path).config)  # past these a sketch or the net only grows (out of memory)
    for flag, value, most, what in (("--sketch-rank", sketch[0], a.hidden_size, "its hidden size"),
                                    ("--sketch-neurons", sketch[1], a.expert_dim, "an expert's neurons"),
                                    ("--lookahead-width", width, 8 * a.hidden_size, "eight times its hidden size")):
        if value > most:
            raise BadInput(f"{flag} {value} is more than this model's {most} ({what}); give at most {most}")
    model, states = record_states(model_path, ids, progress=progress and (lambda n: progress("record", n, len(ids))),
                                  pre=True, sketch=sketch)
    k = model.args.top_k
    qh_recall = recall_per_layer(QuasiHidden(model, dv), states, k)
    net = train_estimator(model, states, dv, epochs=epochs, progress=progress)
    est_recall = recall_per_layer(Estimator(model, dv, net), states, k)
    hybrid = [l for l, r in enumerate(qh_recall) if r < hybrid_below and est_recall[l] > r]
    recall = {"quasi-hidden": qh_recall, "estimator": est_recall}
    save_estimator(net, Path(model_path), hybrid, recall)
    tokens = len(states.starts) * len(net.transitions)
    sketch = ExpertSketch.from_tensors(states.sketch.tensors(), states.sketch.kind)  # as its file gives it to decode
    add_lookahead(model, states, sketch, progress and (lambda n: progress("ahead", n, tokens)))
    ahead = train_estimator(model, states, dv, epochs=epochs, progress=progress, lookahead=True, width=width)
    recall["lookahead"] = recall_per_layer(Lookahead(model, dv, ahead, sketch), states, k)
    save_estimator(ahead, Path(model_path), [], {"lookahead": recall["lookahead"]}, LOOKAHEAD_FILE, sketch)
    return {"tokens": len(states.x[0]), "hybrid_layers": hybrid, "calibration_recall": recall}


def record_for(model_path: Path, ids: list[int], predictors, context: int = 512,
               progress: Callable[[str, int, int], None] | None = None) -> tuple[Transformer, LayerStates]:
    """record_states over `ids`, with the lookahead's inputs where `predictors` name it (`progress(stage, done,
    total)`: the tokens recorded, then the lookahead's inputs)."""
    check_predictor_files(model_path, predictors)  # before the minutes of recording
    model, states = record_states(model_path, ids, context,
                                  progress=progress and (lambda n: progress("record", n, len(ids))),
                                  pre="lookahead" in predictors)
    if "lookahead" in predictors:
        tokens = len(states.starts) * (model.args.num_moe_layers - 1)
        add_lookahead(model, states, load_estimator(model_path, model, LOOKAHEAD_FILE)[2],
                      progress and (lambda n: progress("ahead", n, tokens)))
    return model, states


def recall_table(model_path: Path, ids: list[int],
                 predictors=PREDICTORS, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """recall@k of each named predictor per layer transition, on the states recorded over `ids`."""
    model, states = record_for(model_path, ids, predictors, progress=progress)
    return {name: recall_per_layer(make_predictor(name, model, Path(model_path)), states, model.args.top_k)
            for name in predictors}


def prediction_routes(model_path: Path, ids: list[int], predictors, context: int = 512,
                      progress: Callable[[str, int, int], None] | None = None
                      ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`predicted_routes` of each named predictor over `ids`, run exactly in windows of `context` (as a trace of
    them is recorded): what a replay in decode order prefetches."""
    model, states = record_for(model_path, ids, predictors, context, progress)
    return {name: predicted_routes(make_predictor(name, model, Path(model_path)), states) for name in predictors}
