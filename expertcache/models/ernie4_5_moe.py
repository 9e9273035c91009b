"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, -300B-A47B): GQA whose RoPE rotates adjacent channel pairs (its q and k rows
are reordered at load, so that the rotation by halves computes the same scores); a softmax router in float32 whose
experts are selected by probability plus a per-expert bias (moe_statics), the gates renormalised; shared experts
without a gate; MoE layers every moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index, the
others dense."""
import torch

from ..errors import UnsupportedArchitecture
from .args import ModelArgs, head_dim, rope_scaling, rope_theta
from .naming import attention_names, dense_mlp_names, expert_names

ARCHITECTURE = "Ernie4_5_MoeForCausalLM"


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from an ERNIE 4.5 MoE config.json (HF's defaults for the keys it omits)."""
    if c.get("use_bias"):
        raise UnsupportedArchitecture("ernie4_5_moe with use_bias: true (biases on every projection) is not "
                                      "supported; the released checkpoints have none")
    norm_min = c.get("moe_norm_min", 1e-12)
    if not isinstance(norm_min, (int, float)) or isinstance(norm_min, bool) or not 0 <= norm_min <= 1e-12:
        # HF divides the gates by max(their sum, moe_norm_min), the router by the sum: the same wherever the chosen
        # experts' probabilities sum past the floor, which at the released 1e-12 is everywhere but underflow
        raise UnsupportedArchitecture(f"ernie4_5_moe with moe_norm_min {norm_min!r} (a floor on the gates' sum) is "
                                      "not supported; the released checkpoints use 1e-12")
    layers = c["num_hidden_layers"]
    start, interval = c.get("moe_layer_start_index", 1), c.get("moe_layer_interval", 1)
    end = c.get("moe_layer_end_index", -1)
    end = layers - 1 if end == -1 else end
    dense = tuple(i for i in range(layers) if not ((i + 1) % interval == 0 and start <= i <= end))
    return ModelArgs(
        family="ernie4_5_moe", vocab_size=c.get("vocab_size", 103424), hidden_size=c.get("hidden_size", 2560),
        num_layers=layers, num_heads=c.get("num_attention_heads", 20),
        num_kv_heads=c.get("num_key_value_heads") or c.get("num_attention_heads", 20),
        head_dim=head_dim({"hidden_size": 2560, "num_attention_heads": 20, **c}),
        num_experts=c.get("moe_num_experts", 64), top_k=c.get("moe_k", 6),
        expert_dim=c.get("moe_intermediate_size", 1536), norm_topk_prob=True, rope_theta=rope_theta(c, 500000.0),
        rms_norm_eps=c.get("rms_norm_eps", 1e-5), tie_word_embeddings=c.get("tie_word_embeddings", True),
        max_position_embeddings=c.get("max_position_embeddings", 131072), rope_scaling=rope_scaling(c),
        router="softmax_selection", router_bias=True, dense_layers=dense,
        dense_dim=c.get("intermediate_size", 12288) if dense else 0,
        shared_expert_dim=(c.get("moe_num_shared_experts", 2) or 0) * c.get("moe_intermediate_size", 1536),
        shared_expert_gate=False)


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's tensors; experts as lists indexed by expert id."""
    p = f"model.layers.{i}.mlp."
    names = attention_names(i, a)
    if a.is_dense(i):
        return {**names, **dense_mlp_names(i)}
    names.update(router=p + "gate.weight", router_bias=p + "moe_statics.e_score_correction_bias",
                 experts=expert_names(p + "experts.", a, "gate_proj", "up_proj", "down_proj"))
    if a.shared_expert_dim:
        names.update(shared_w1=p + "shared_experts.gate_proj.weight", shared_w3=p + "shared_experts.up_proj.weight",
                     shared_w2=p + "shared_experts.down_proj.weight")
    return names


def adapt_dense(w: dict[str, torch.Tensor], a: ModelArgs) -> dict[str, torch.Tensor]:
    """Each head's q and k rows in the order [0, 2, 4, ..., 1, 3, 5, ...]: the rotation by halves then turns the
    pairs (2j, 2j + 1) that ERNIE rotates by frequency j (scores q.k are the same under one reordering of both);
    the selection bias [1, E] as [E]."""
    order = torch.cat([torch.arange(0, a.head_dim, 2), torch.arange(1, a.head_dim, 2)])
    out = dict(w)
    for name, t in w.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("wq", "wk"):
            out[name] = t.reshape(-1, a.head_dim, t.shape[-1])[:, order].reshape(t.shape)
        elif kind == "router_bias":
            out[name] = t.reshape(-1)
    return out
