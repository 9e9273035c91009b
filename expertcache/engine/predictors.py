"""Predicting layer l+1's experts from layer l's state, all behind one interface.

A predictor maps, for the tokens of one MoE call at layer l, the residual stream after
layer l's attention r_l [T, H], layer l's normed MoE input x_l [T, H] and the experts
executed at layer l (ids [T, k], weights [T, k]) to router logits for layer l+1 [T, E].
It is available before layer l's experts run, so their transfers overlap that compute.
Where the engine knows them, it also passes `prev`: the experts the same sequence's previous
token ran at layer l+1 (ids, weights [T, k]; weight 0 where a token has none).

- router-ahead: Router_{l+1}(x_l), the naive baseline;
- quasi-hidden: Router_{l+1}(Norm_{l+1}(r_l + d_l)), d_l the gate-weighted default vectors;
- estimator: one small feed-forward net per layer transition on the quasi-hidden state and the
  previous token's experts at l+1 (consecutive tokens share experts), distilled by KL to the
  true next-layer router;
- hybrid: the estimator on the layers where quasi-hidden recall is weak, quasi-hidden elsewhere;
- lookahead: layer l+1's router plus a net of the estimator's shape, on layer l+1's own MoE input as
  its attention gives it when run early on r_l + s_l (keys and values of earlier tokens exact), s_l
  the gate-weighted outputs of the executed experts' sketches on x_l (`ExpertSketch`): the
  attention's context and the experts' dependence on their input are what the quasi-hidden state
  lacks most. It costs one attention block and the sketches' products more per layer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..atomic import replaced
from ..choices import LOOKAHEAD_WIDTH, PREDICTORS, SKETCH_NEURONS, SKETCH_RANK  # noqa: F401 (re-exported)
from ..errors import CheckpointError
from ..kernel import dense_decode
from ..kernel.routing import Router, Routing
from . import threads
from .checkpoint import DEFAULT_VECTORS, ESTIMATOR_FILE, LOOKAHEAD_FILE
from .experts import KERNEL_VIEWS, SWIGLU, ExpertKind, kernel_view
from .moe import check_predictor, decode_router_logits, router_logits
from .tensor_file import CHECKSUM, check_checksum, tensors_checksum
from .transformer import Transformer



class Predictor:
    """Predicts layer l+1's router logits from layer l's state; subclasses implement `logits`."""
    name = "predictor"

    def __init__(self, model: Transformer):
        self.model = model

    def logits(self, layer: int, resid: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """resid [T, H], x [T, H], ids [T, k], weights [T, k] at `layer` (and `prev`, the previous tokens'
        ids and weights [T, k] at layer+1, or None) -> logits for layer+1 [T, E]."""
        raise NotImplementedError

    def decode_logits(self, layer: int, resid: torch.Tensor, x: torch.Tensor, ids: np.ndarray,
                      weights: np.ndarray, prev: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray | None:
        """One decode token's `logits` as an array [1, E] (resid, x [1, H]; ids, weights [k]; prev: ids and
        weights [k] or None) where a predictor has a faster path for it; None otherwise (the caller takes
        `logits`)."""
        return None

    def route(self, layer: int, x: torch.Tensor, weight: torch.Tensor, router: Router) -> Routing | None:
        """Layer `layer`'s routing of a decode token's x [1, H] (router weight [E, H]) where this predictor computes
        it together with its own prediction for layer+1 (kept for `decode_logits`); None: the caller routes."""
        return None

    def _router_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """MoE layer l+1's router weight on x [T, H] -> [T, E]: logits without the router's bias, which
        the model's Router adds when it routes them (kernel/routing.Router.route); computed as the model's
        MoE layer computes them (a sigmoid router's in float32)."""
        return router_logits(x, self.model.moe_layers[layer + 1]["router"], self.model.router)


class RouterAhead(Predictor):
    """Router_{l+1}(x_l): the next layer's router on this layer's normed MoE input."""
    name = "router-ahead"

    def __init__(self, model: Transformer):
        super().__init__(model)
        self._ahead: tuple[torch.Tensor, np.ndarray] | None = None  # (x, layer+1's logits) computed by `route`

    def logits(self, layer, resid, x, ids, weights, prev=None):
        """x [T, H] -> Router_{l+1}(x) [T, E]."""
        return self._router_logits(layer, x)

    def route(self, layer, x, weight, router):
        """Layer l's router and layer l+1's on the same decode input, in one compiled call: the prediction costs
        one more product of the routing call (~2 us here), not a call of its own (~10 us hot, ~30 in place)."""
        logits = decode_router_logits(x, weight, self.model.moe_layers[layer + 1]["router"])
        if logits is None:
            return None
        self._ahead = (x, logits[1:])
        return router.route(logits[:1], layer)

    def decode_logits(self, layer, resid, x, ids, weights, prev=None):
        """The logits `route` computed from this x, else one compiled product on the CPU (fp32 x and router), as
        the engine's own routing of a decode token."""
        if self._ahead is not None and self._ahead[0] is x:
            logits, self._ahead = self._ahead[1], None
            return logits
        return decode_router_logits(x, self.model.moe_layers[layer + 1]["router"])


class QuasiHidden(Predictor):
    """Router_{l+1} on the quasi-hidden state: the residual plus the gate-weighted default vectors of the
    experts executed at layer l, normed as layer l+1 would."""
    name = "quasi-hidden"

    def __init__(self, model: Transformer, default_vectors: torch.Tensor):
        super().__init__(model)
        a = model.args
        if tuple(default_vectors.shape) != (a.num_moe_layers, a.num_experts, a.hidden_size):
            raise CheckpointError(f"the default vectors ({DEFAULT_VECTORS}) of shape {tuple(default_vectors.shape)} do "
                                  f"not fit the model's {a.num_moe_layers} MoE layers x {a.num_experts} experts x "
                                  f"hidden size {a.hidden_size}; rerun `expertcache calibrate --model MODEL` on "
                                  "its folder")
        self.default_vectors = default_vectors.to(model.device, model.dtype)
        self._decode: list[tuple] | None = None  # per layer, the compiled call's arrays (decode_logits)

    def quasi_hidden(self, layer, resid, ids, weights) -> torch.Tensor:
        """q_l = Norm_{l+1}(r_l + sum_j g_j d_{l, e_j}) [T, H]."""
        assert ids.shape == weights.shape and ids.shape[0] == resid.shape[0], \
            f"resid must be [T, H], ids and weights [T, k], got {tuple(resid.shape)}, {tuple(ids.shape)}, " \
            f"{tuple(weights.shape)}"
        d = (self.default_vectors[layer][ids] * weights.unsqueeze(-1).to(resid.dtype)).sum(1)
        a = self.model.args
        return F.rms_norm(resid + d, (a.hidden_size,), self.model.moe_layers[layer + 1]["moe_norm"], a.rms_norm_eps)

    def logits(self, layer, resid, x, ids, weights, prev=None):
        """Router_{l+1}(q_l) [T, E]."""
        if self._compiled(resid):  # decode on the CPU: one compiled call
            return torch.from_numpy(self.decode_logits(layer, resid, x, ids.numpy()[0], weights.numpy()[0]))
        return self._router_logits(layer, self.quasi_hidden(layer, resid, ids, weights))

    def decode_logits(self, layer, resid, x, ids, weights, prev=None):
        """One compiled call on the CPU (fp32 residual and router), over arrays taken once."""
        if not self._compiled(resid):
            return None
        vectors, norm, router = self._arrays()[layer]
        out = np.empty((1, router.shape[0]), np.float32)
        dense_decode.quasi_hidden_logits(resid.numpy()[0], vectors, ids, weights, norm, self._eps, router, self._q,
                                         out[0])
        return out

    def _arrays(self) -> list[tuple]:
        """Per layer, the default vectors, layer l+1's MoE norm and router as arrays, for the compiled calls."""
        if self._decode is None:
            a, layers = self.model.args, self.model.moe_layers
            self._decode = [(self.default_vectors[l].numpy(), layers[l + 1]["moe_norm"].numpy(),
                             kernel_view(layers[l + 1]["router"])) for l in range(len(layers) - 1)]
            self._eps, self._q = np.float32(a.rms_norm_eps), np.empty(a.hidden_size, np.float32)
        return self._decode

    def _compiled(self, resid: torch.Tensor) -> bool:
        return resid.shape[0] == 1 and resid.device.type == "cpu" and resid.dtype == torch.float32 \
            and self.model.moe_layers[0]["router"].dtype in KERNEL_VIEWS


class Transition(nn.Module):
    """The estimator of one layer transition l -> l+1: fc2 silu(fc1 q + sum_j w_j prev[e_j]), with q the
    quasi-hidden state [T, H] and (e_j, w_j) the experts the previous token ran at layer l+1 [T, k]."""

    def __init__(self, hidden: int, experts: int, width: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, width)
        self.prev = nn.EmbeddingBag(experts, width, mode="sum")  # a row per expert, summed with its weight
        # initialised as a linear layer over the experts' weights would be, not N(0, 1): noise that training must undo
        nn.init.uniform_(self.prev.weight, -experts ** -0.5, experts ** -0.5)
        self.fc2 = nn.Linear(width, experts)

    def forward(self, q: torch.Tensor, prev_ids: torch.Tensor, prev_weights: torch.Tensor) -> torch.Tensor:
        """q [T, H], prev ids (long) and weights [T, k] (0 where unknown) -> logits [T, E]."""
        h = self.fc1(q) + self.prev(prev_ids, per_sample_weights=prev_weights.to(q.dtype))
        return self.fc2(F.silu(h))


class EstimatorNet(nn.Module):
    """One `Transition` per layer transition: each layer's routing is its own function, and a net per
    transition predicts it better than one shared net of the same decode cost (84.0% against 80.7% recall@8 on
    the built-in model)."""

    def __init__(self, hidden: int, experts: int, transitions: int, width: int = 512):
        super().__init__()
        self.transitions = nn.ModuleList(Transition(hidden, experts, width) for _ in range(transitions))

    def forward(self, layer: int, q: torch.Tensor, prev_ids: torch.Tensor, prev_weights: torch.Tensor
                ) -> torch.Tensor:
        """Transition layer -> layer+1 on q [T, H] and the previous tokens' experts at layer+1 [T, k]."""
        return self.transitions[layer](q, prev_ids, prev_weights)


def no_previous(tokens: int, k: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`prev` for tokens whose previous token's experts are unknown: ids 0 with weight 0."""
    return torch.zeros(tokens, k, dtype=torch.long, device=device), torch.zeros(tokens, k, device=device)


class Estimator(QuasiHidden):
    """EstimatorNet on the quasi-hidden state; with `layers`, only there (the hybrid), quasi-hidden elsewhere."""
    name = "estimator"

    def __init__(self, model: Transformer, default_vectors: torch.Tensor, net: EstimatorNet,
                 layers: set[int] | None = None):
        super().__init__(model, default_vectors)
        self.net = net.to(model.device).eval()
        self._float_net = net.transitions[0].fc1.weight.dtype == torch.float32  # what the compiled calls take
        self.layers = layers  # None: every layer; else only these, quasi-hidden elsewhere
        self._net: list[tuple[np.ndarray, ...]] | None = None  # per transition, the net's arrays (decode_logits)
        self._none = (np.zeros(0, np.int64), np.zeros(0, np.float32))  # an unknown previous token

    def decode_logits(self, layer, resid, x, ids, weights, prev=None):
        """One compiled call on the CPU (fp32 residual, router and net) for the net's layers, quasi-hidden's
        elsewhere: a decode token's prediction then costs one pass over the transition's weights instead of the
        net's PyTorch calls."""
        if self.layers is not None and layer not in self.layers:
            return super().decode_logits(layer, resid, x, ids, weights)
        if not self._compiled(resid) or not self._float_net:
            return None
        vectors, norm, _ = self._arrays()[layer]
        w1, b1, rows, w2, b2 = self._net_arrays()[layer]
        prev_ids, prev_weights = self._none if prev is None else prev
        out = np.empty((1, w2.shape[0]), np.float32)
        dense_decode.estimator_logits(resid.numpy()[0], vectors, ids, weights, norm, self._eps, w1, b1, rows,
                                      prev_ids, prev_weights, w2, b2, self._q, self._hidden, out[0])
        return out

    def _net_arrays(self) -> list[tuple[np.ndarray, ...]]:
        """Per transition, the net's weights as arrays for the compiled calls."""
        if self._net is None:
            self._net = [tuple(t.detach().numpy() for t in (n.fc1.weight, n.fc1.bias, n.prev.weight, n.fc2.weight,
                                                            n.fc2.bias)) for n in self.net.transitions]
            self._hidden = np.empty(self._net[0][0].shape[0], np.float32)
        return self._net

    def logits(self, layer, resid, x, ids, weights, prev=None):
        """The estimator's logits for layer+1 [T, E], or quasi-hidden's on layers it does not cover."""
        q = self.quasi_hidden(layer, resid, ids, weights)
        if self.layers is not None and layer not in self.layers:
            return self._router_logits(layer, q)
        prev_ids, prev_weights = no_previous(*ids.shape, q.device) if prev is None else prev
        with torch.no_grad():
            return self.net(layer, q.float(), prev_ids.long(), prev_weights.float()).to(q.dtype)


SKETCH_PARTS = ("means", "inputs", "bias", "outputs", "gate", "up", "gate_bias", "up_bias", "down")


class ExpertSketch:
    """A small stand-in for each expert of the layers a lookahead predicts from: expert e of MoE layer l on its
    input x [H] gives about
        means[l, e] + (inputs[l, e] x + bias[l, e]) outputs[l, e] + glu(gate[l, e] x + gate_bias, up x + up_bias) down
    its mean output (its default vector), a low-rank linear map of its input (rank r), and its n most important
    neurons exact (its own gated activation). `fit` keeps the neurons that carry the most of its output on
    calibration tokens and fits the linear map to the rest by reduced-rank ridge regression. On the built-in
    model (rank 16, 8 neurons) a sketch leaves 14-27% of a layer's MoE output unexplained where the default
    vectors leave 65-81%, and layer l+1's router on the attention run ahead of r_l + s_l picks 95-98% of its
    true experts against 76-88% on r_l + d_l. Arrays (float32 as fitted, fp16 as a file holds them: half the bytes,
    for an error far below the sketch's own; for the L source layers): means [L, E, H], inputs and outputs
    [L, E, r, H], bias [L, E, r], gate, up and down [L, E, n, H], gate_bias and up_bias [L, E, n]."""

    def __init__(self, *arrays: torch.Tensor, kind: ExpertKind = SWIGLU):
        if len(arrays) != len(SKETCH_PARTS):
            raise ValueError(f"a sketch has {len(SKETCH_PARTS)} arrays, got {len(arrays)}")
        L, E, H = arrays[0].shape
        r, n = arrays[1].shape[2], arrays[4].shape[2]
        if [tuple(t.shape) for t in arrays] != [(L, E, *shape) for shape in ExpertSketch.shapes(H, r, n)]:
            raise ValueError(f"sketch arrays of shapes {[tuple(t.shape) for t in arrays]} disagree")
        self.arrays = tuple(t.contiguous() for t in arrays)  # in SKETCH_PARTS' order
        self.kind = kind

    @property
    def shape(self) -> tuple[int, int, int]:
        """(source layers, experts, hidden size)."""
        return tuple(self.arrays[0].shape)

    @property
    def rank(self) -> int:
        return self.arrays[1].shape[2]

    @property
    def neurons(self) -> int:
        return self.arrays[4].shape[2]

    @property
    def activation(self) -> tuple[bool, np.float32, np.float32]:
        """The gated activation as dense_decode.sketch_sum takes it: (clamped, limit, alpha)."""
        return self.kind.limit is not None, np.float32(self.kind.limit or 0), np.float32(self.kind.alpha)

    @staticmethod
    def shapes(hidden: int, rank: int, neurons: int) -> list[tuple[int, ...]]:
        """The shapes of one expert's arrays, in SKETCH_PARTS' order."""
        H, r, n = hidden, rank, neurons
        return [(H,), (r, H), (r,), (r, H), (n, H), (n, H), (n,), (n,), (n, H)]

    @staticmethod
    def fit(x: torch.Tensor, y: torch.Tensor, parts: list[torch.Tensor], kind: ExpertKind, rank: int, neurons: int,
            ridge: float = 1e-2) -> tuple[torch.Tensor, ...]:
        """One expert's sketch (its arrays without the layer and expert axes) from the inputs x [n, H] of the
        tokens routed to it, its outputs y [n, H] and its weights `parts` (w13 [2F, H], w2 [H, F], and b13 [2F],
        b2 [H] where it has biases). The `neurons` of most output energy on these tokens are kept exact; the
        rest of y is fitted by ridge regression of its centred values on the centred inputs (`ridge` of the
        inputs' mean energy a channel, so that an expert seen on few tokens is not overfitted), projected on the
        fit's top `rank` directions: the best rank-r map of that fit. No tokens: zeros (an expert never routed)."""
        n, H = x.shape
        out = [torch.zeros(shape) for shape in ExpertSketch.shapes(H, rank, neurons)]
        if n == 0:
            return tuple(out)
        x, y = x.float(), y.float()
        w13, w2 = parts[0].float(), parts[1].float()
        b13 = parts[2].float() if len(parts) > 2 else torch.zeros(w13.shape[0])
        F_ = w2.shape[1]
        act = kind.glu(*F.linear(x, w13, b13).chunk(2, dim=-1))  # [n, F]
        keep = ((act * act).mean(0) * (w2 * w2).sum(0)).argsort(descending=True)[:min(neurons, F_)]
        m = len(keep)
        out[4][:m], out[5][:m], out[6][:m], out[7][:m] = w13[keep], w13[F_ + keep], b13[keep], b13[F_ + keep]
        out[8][:m] = w2[:, keep].T
        rest = y - act[:, keep] @ w2[:, keep].T
        mx, my = x.mean(0), rest.mean(0)
        out[0] = my
        xc, yc = x - mx, rest - my
        lam = ridge * float((xc * xc).sum()) / H + 1e-12
        r = min(rank, n - 1, H)
        if r > 0:
            if n >= H:  # the primal system is the smaller: [H, H]
                b = torch.linalg.solve(xc.T @ xc + lam * torch.eye(H), xc.T @ yc)
            else:  # the dual: [n, n]
                b = xc.T @ torch.linalg.solve(xc @ xc.T + lam * torch.eye(n), yc)
            directions = torch.linalg.svd(xc @ b, full_matrices=False).Vh[:r]  # [r, H]
            out[1][:r], out[3][:r] = (b @ directions.T).T, directions
            out[2][:r] = -(out[1][:r] @ mx)
        return tuple(out)

    def estimate(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] sketch_{layer, ids[:, j]}(x) [T, H] for x [T, H], ids and weights [T, k]."""
        k = ids.shape[1]
        flat, w = ids.reshape(-1).cpu(), weights.reshape(-1).float()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in flat.unique().tolist():
            pos = (flat == e).nonzero().flatten()
            tok = (pos // k).to(x.device)
            xe = x[tok].float()
            means, inputs, bias, outputs, gate, up, gate_bias, up_bias, down = (t[layer, e].float() for t in self.arrays)
            act = self.kind.glu(xe @ gate.T + gate_bias, xe @ up.T + up_bias)
            y = means + (xe @ inputs.T + bias) @ outputs + act @ down
            out.index_add_(0, tok, y * w[pos.to(w.device)].unsqueeze(-1))
        return out.to(x.dtype)

    def to(self, device: torch.device) -> "ExpertSketch":
        return ExpertSketch(*(t.to(device) for t in self.arrays), kind=self.kind)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The arrays as a checkpoint file holds them, fp16."""
        return {f"sketch.{n}": t.half() for n, t in zip(SKETCH_PARTS, self.arrays)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], kind: ExpertKind) -> "ExpertSketch":
        return cls(*(tensors[f"sketch.{n}"] for n in SKETCH_PARTS), kind=kind)


class Lookahead(Estimator):
    """Layer l+1's router plus the net, on layer l+1's MoE input as layer l+1's attention gives it on r_l + s_l
    (s_l: the executed experts' sketches on x_l), run ahead at the forward's positions
    (Transformer.attention_ahead); where it cannot run (linear attention, a decode batch) on the normed
    r_l + s_l itself, as it was trained to there. The router carries what the net need not learn: trained on top
    of it the net predicts 3 points better than alone (built-in model)."""
    name = "lookahead"

    def __init__(self, model: Transformer, default_vectors: torch.Tensor, net: EstimatorNet, sketch: ExpertSketch):
        super().__init__(model, default_vectors, net)
        a = model.args
        if sketch.shape != (a.num_moe_layers - 1, a.num_experts, a.hidden_size):
            raise CheckpointError(f"the lookahead's expert sketches of shape {sketch.shape} do not fit "
                                  "the model; run `expertcache predict --train --model MODEL` on its folder")
        self.sketch = sketch if model.device.type == "cpu" else sketch.to(model.device)
        self._sketch: list[tuple[np.ndarray, ...]] | None = None  # per layer, its arrays (decode_logits)

    def ahead_input(self, layer: int, resid: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """The net's input [T, H] at transition layer -> layer+1 (resid, x [T, H], ids and weights [T, k])."""
        return lookahead_input(self.model, layer, resid, x, self.sketch, ids, weights)

    def net_logits(self, layer: int, inputs: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> torch.Tensor:
        """Layer layer+1's router plus the net of transition layer -> layer+1 on its inputs [T, H] -> [T, E]."""
        prev_ids, prev_weights = no_previous(inputs.shape[0], self.model.args.top_k, inputs.device) \
            if prev is None else prev
        with torch.no_grad():
            net = self.net(layer, inputs.float(), prev_ids.long(), prev_weights.float())
            return (net + self._router_logits(layer, inputs).float()).to(inputs.dtype)

    def logits(self, layer, resid, x, ids, weights, prev=None):
        return self.net_logits(layer, self.ahead_input(layer, resid, x, ids, weights), prev)

    def decode_logits(self, layer, resid, x, ids, weights, prev=None):
        """Three compiled calls and no torch operation: the sketches' sum, the attention ahead (the model's compiled
        decode block, from and into arrays of the predictor's own) and the router with the net."""
        if not self._compiled(resid) or not self._float_net:
            return None
        sketch, h, q = self._sketch_arrays()[layer], self._h, self._ahead
        dense_decode.sketch_sum(resid.numpy()[0], x.float().numpy()[0], *sketch, ids, weights, *self._activation,
                                self._z, self._acc, h)
        model = self.model
        if not model.attention_ahead_token(model.args.moe_layers[layer + 1], h, q):  # torch's path, or the normed h
            q = run_ahead(model, layer, torch.from_numpy(h)[None], own=True).float().numpy()[0]
        w1, b1, rows, w2, b2 = self._net_arrays()[layer]
        prev_ids, prev_weights = self._none if prev is None else prev
        out = np.empty((1, w2.shape[0]), np.float32)
        dense_decode.lookahead_logits(q, self._arrays()[layer][2], w1, b1, rows, prev_ids, prev_weights, w2, b2,
                                      self._hidden, out[0], self._net_threads)
        return out

    def _sketch_arrays(self) -> list[tuple[np.ndarray, ...]]:
        """Per source layer, the sketch's arrays for the compiled sum; and the decode call's scratch and threads."""
        if self._sketch is None:
            s = self.sketch
            self._sketch = [tuple(kernel_view(t[l]) for t in s.arrays) for l in range(s.shape[0])]
            # a call streams k experts' sketches, the net's matrices and the router: each split over threads where
            # that pays (threads.parts; at real size both, 1.9 and 1.5 MB)
            per_expert = sum(t[0, 0].numel() * t.element_size() for t in s.arrays)
            P = threads.parts(self.model.args.top_k * per_expert)
            w1, _, _, w2, _ = self._net_arrays()[0]
            self._net_threads = threads.parts(w1.nbytes + w2.nbytes + self._arrays()[0][2].nbytes)
            self._z, self._activation = np.empty((P, max(s.rank, 1)), np.float32), s.activation
            self._acc = np.empty((P, s.shape[2]), np.float32)
            self._h, self._ahead = np.empty(s.shape[2], np.float32), np.empty(s.shape[2], np.float32)
        return self._sketch


def lookahead_input(model: Transformer, layer: int, resid: torch.Tensor, x: torch.Tensor, sketch: ExpertSketch,
                    ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Layer layer+1's MoE input [T, H] as its attention, run ahead, gives it on r + s (resid, x [T, H] at `layer`;
    s the gate-weighted sketches of ids, weights [T, k] on x); the normed r + s where the attention cannot run
    ahead."""
    return run_ahead(model, layer, resid + sketch.estimate(layer, x, ids, weights).to(resid.dtype))


def run_ahead(model: Transformer, layer: int, h: torch.Tensor, own: bool = False) -> torch.Tensor:
    """Layer layer+1's attention run ahead on h [T, H], an estimate of its input: its MoE input [T, H]; where it
    cannot run, h normed as layer layer+1's MoE input. `own`: as Transformer.attention_ahead's."""
    a = model.args
    ahead = model.attention_ahead(a.moe_layers[layer + 1], h, own)
    if ahead is None:
        ahead = F.rms_norm(h, (a.hidden_size,), model.moe_layers[layer + 1]["moe_norm"], a.rms_norm_eps)
    return ahead


ESTIMATOR_VERSION = "2"  # 1: one net for every transition, without the previous token's experts
LOOKAHEAD_VERSION = "3"  # 2: the net alone, on the attention ahead of the default vectors


def save_estimator(net: EstimatorNet, path: Path, hybrid_layers: list[int], recall: dict,
                   file: str = ESTIMATOR_FILE, sketch: ExpertSketch | None = None) -> None:
    """Write the net to `file` (estimator.safetensors, or with its `sketch` lookahead.safetensors for the
    lookahead's) in `path`, with its shape, hybrid layers and calibration recall as metadata."""
    import json
    t = net.transitions[0]
    meta = {"version": ESTIMATOR_VERSION if sketch is None else LOOKAHEAD_VERSION,
            "hidden": str(t.fc1.in_features), "experts": str(t.fc2.out_features),
            "transitions": str(len(net.transitions)), "width": str(t.fc1.out_features),
            "hybrid_layers": json.dumps(hybrid_layers), "calibration_recall": json.dumps(recall)}
    tensors = {k: v.contiguous() for k, v in net.state_dict().items()}
    if sketch is not None:
        meta["sketch_rank"], meta["sketch_neurons"] = str(sketch.rank), str(sketch.neurons)
        tensors.update(sketch.tensors())
    meta[CHECKSUM] = tensors_checksum(tensors)
    with replaced(path / file) as tmp:  # a server may be loading the one it replaces
        save_file(tensors, str(tmp), metadata=meta)


def load_estimator(path: Path, model: Transformer | None = None, file: str = ESTIMATOR_FILE
                   ) -> tuple[EstimatorNet, list[int], ExpertSketch | None]:
    """The net saved as `file` in `path`, the layers the hybrid uses it on and the lookahead's expert sketches
    (None in the estimator's file); with `model`, checked to be its shape."""
    import json

    from safetensors import SafetensorError, safe_open
    f = Path(path) / file
    retrain = f"run `expertcache predict --train --model {path}`"
    if not f.exists():
        raise CheckpointError(f"{f} is missing; {retrain}")
    want = LOOKAHEAD_VERSION if file == LOOKAHEAD_FILE else ESTIMATOR_VERSION
    try:
        with safe_open(str(f), "pt") as h:
            meta = h.metadata() or {}
        if meta.get("version") != want:
            raise CheckpointError(f"{f} was trained by an older expertcache ("
                                  f"{'without expert sketches' if file == LOOKAHEAD_FILE else 'one net for every layer'}"
                                  f"); {retrain} again")
        shape = tuple(int(meta[k]) for k in ("hidden", "experts", "transitions", "width"))
        if model is not None and shape[:3] != (model.args.hidden_size, model.args.num_experts,
                                               model.args.num_moe_layers - 1):
            raise CheckpointError(f"{f} was trained for another model (hidden size, experts and layer transitions "
                                  f"{shape[:3]}); {retrain}")
        tensors = load_file(str(f))
        check_checksum(f, tensors, meta, retrain)
        # an integer tensor was read as numbers it is not (or failed in a compiled call), a NaN one predicted
        # silently worse: both are a corrupt file
        for name, t in tensors.items():
            bad = f"{str(t.dtype).removeprefix('torch.')}, not floats" if not t.dtype.is_floating_point \
                else "NaN or infinite values" if not torch.isfinite(t).all() else None
            if bad:
                raise CheckpointError(f"{f}: tensor {name} holds {bad} (a corrupt file); {retrain}")
        net = EstimatorNet(*shape)
        net.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("sketch.")})
        sketch = None if want != LOOKAHEAD_VERSION else \
            ExpertSketch.from_tensors(tensors, SWIGLU if model is None else ExpertKind.of(model.args))
        hybrid = [int(l) for l in json.loads(meta["hybrid_layers"])]
        if not all(0 <= l < shape[2] for l in hybrid):
            raise ValueError(f"hybrid layers {hybrid} are not among its {shape[2]} layer transitions")
        return net, hybrid, sketch
    except (SafetensorError, OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{f} is unreadable ({str(e).splitlines()[0][:200]}); {retrain}") from None


_SAFETENSOR_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}
# the files each predictor loads from the model's folder (make_predictor)
PREDICTOR_FILES = {"router-ahead": (), "quasi-hidden": (DEFAULT_VECTORS,),
                   "estimator": (DEFAULT_VECTORS, ESTIMATOR_FILE), "hybrid": (DEFAULT_VECTORS, ESTIMATOR_FILE),
                   "lookahead": (DEFAULT_VECTORS, LOOKAHEAD_FILE)}


def predictor_bytes(name: str, model_path: Path, dtype: torch.dtype) -> int:
    """Memory the predictor `name` takes once attached, from its files' headers before any is read: its default
    vectors in the compute `dtype`, its nets and sketches as stored, and its nets once more, the copy that loading
    reads them into before the module takes them. A file that is missing or unreadable counts 0: attaching the
    predictor then names the fix."""
    from safetensors import SafetensorError, safe_open
    check_predictor(name)
    total = 0
    for file in PREDICTOR_FILES[name]:
        try:
            with safe_open(str(Path(model_path) / file), "pt") as f:
                for key in f.keys():
                    t = f.get_slice(key)
                    n = int(np.prod(t.get_shape()))
                    if key == "default_vectors":
                        total += n * dtype.itemsize
                    elif key != "counts":  # the vectors' token counts are not kept
                        held = n * _SAFETENSOR_BYTES.get(t.get_dtype(), 4)
                        total += held * (1 if key.startswith("sketch.") else 2)
        except (SafetensorError, OSError):
            continue
    return total



def check_predictor_files(model_path: Path, names) -> None:
    """CheckpointError, naming the command that writes it, unless the files the named predictors load from
    `model_path` are there and readable: what records a text's states first learnt of a missing one minutes in."""
    from .checkpoint import load_default_vectors
    files = {file for name in names for file in PREDICTOR_FILES.get(name, ())}
    if DEFAULT_VECTORS in files:  # first, as predict --train writes them
        load_default_vectors(model_path)
    for file in (ESTIMATOR_FILE, LOOKAHEAD_FILE):
        if file in files:
            load_estimator(model_path, file=file)


def make_predictor(name: str, model: Transformer, model_path: Path) -> Predictor:
    """The predictor named `name` (one of PREDICTORS) for `model`, loading its files from `model_path`."""
    from .checkpoint import load_default_vectors
    check_predictor(name)
    if name == "router-ahead":
        return RouterAhead(model)
    if name == "quasi-hidden":
        return QuasiHidden(model, load_default_vectors(model_path))
    if name in ("estimator", "hybrid"):
        net, hybrid_layers, _ = load_estimator(model_path, model)
        p = Estimator(model, load_default_vectors(model_path), net, set(hybrid_layers) if name == "hybrid" else None)
        p.name = name
        return p
    if name == "lookahead":
        net, _, sketch = load_estimator(model_path, model, LOOKAHEAD_FILE)
        return Lookahead(model, load_default_vectors(model_path), net, sketch)
    raise AssertionError(name)  # check_predictor knows no other
