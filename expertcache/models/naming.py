"""Checkpoint tensor names shared by the families (HF's layout of attention and experts)."""
from __future__ import annotations

from ..errors import UnsupportedArchitecture
from .args import ModelArgs


def qwen_dense_fields(c: dict) -> dict:
    """ModelArgs fields of the Qwen families' dense layers: those in mlp_only_layers, and all but every
    decoder_sparse_step-th (HF's rule), each a SwiGLU MLP of intermediate_size."""
    step, only = c.get("decoder_sparse_step"), c.get("mlp_only_layers") or []
    step = 1 if step is None else step  # 0 is refused below, as HF divides by it, not read as 1
    if type(step) is not int or step < 1 or not all(type(i) is int for i in only):
        raise UnsupportedArchitecture(f"{c.get('model_type')}: decoder_sparse_step {step!r} or mlp_only_layers "
                                      f"{only!r} is not whole layer numbers; restore the config from the release")
    dense = tuple(i for i in range(c["num_hidden_layers"]) if i in only or (i + 1) % step)
    return dict(dense_layers=dense, dense_dim=c["intermediate_size"] if dense else 0)


def dense_mlp_names(i: int) -> dict:
    """Layer i's dense SwiGLU MLP, as HF's Qwen, DeepSeek and GLM families name it."""
    p = f"model.layers.{i}.mlp."
    return {"dense_w1": p + "gate_proj.weight", "dense_w3": p + "up_proj.weight", "dense_w2": p + "down_proj.weight"}


def attention_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's norms and (GQA) attention."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    names = {"attn_norm": p + "input_layernorm.weight", "moe_norm": p + "post_attention_layernorm.weight",
             "wq": attn + "q_proj.weight", "wk": attn + "k_proj.weight", "wv": attn + "v_proj.weight",
             "wo": attn + "o_proj.weight"}
    if a.attention_bias:
        names.update(bq=attn + "q_proj.bias", bk=attn + "k_proj.bias", bv=attn + "v_proj.bias")
    if a.o_proj_bias:
        names.update(bo=attn + "o_proj.bias")
    if a.qk_norm:
        names.update(q_norm=attn + "q_norm.weight", k_norm=attn + "k_norm.weight")
    return names


def expert_names(prefix: str, a: ModelArgs, w1: str, w3: str, w2: str) -> dict:
    """Per-expert tensor names under `prefix` ('model.layers.{i}.mlp.experts.'), as lists indexed by expert id."""
    return {"w1": [f"{prefix}{j}.{w1}.weight" for j in range(a.num_experts)],
            "w3": [f"{prefix}{j}.{w3}.weight" for j in range(a.num_experts)],
            "w2": [f"{prefix}{j}.{w2}.weight" for j in range(a.num_experts)]}


def per_expert_names(i: int, a: ModelArgs, moe: str, gate: str, w1: str, w3: str, w2: str) -> dict:
    """Our name -> checkpoint name for layer i; experts as lists indexed by expert id (a dense layer: its MLP)."""
    p = f"model.layers.{i}."
    names = attention_names(i, a)
    if a.is_dense(i):
        return {**names, **dense_mlp_names(i)}
    names["router"] = p + f"{moe}.{gate}.weight"
    names["experts"] = expert_names(p + f"{moe}.experts.", a, w1, w3, w2)
    return names


def deepseek_mlp_names(i: int, a: ModelArgs) -> dict:
    """Layer i's MLP tensors as DeepSeek-V3 and GLM-4.5 name them: a dense SwiGLU MLP in the first
    first_dense_layers layers; elsewhere a router with its selection bias, shared experts and routed experts."""
    p = f"model.layers.{i}.mlp."
    if a.is_dense(i):
        return dense_mlp_names(i)
    names = {"router": p + "gate.weight", "experts": expert_names(p + "experts.", a, "gate_proj", "up_proj",
                                                                   "down_proj")}
    if a.router_bias:
        names["router_bias"] = p + "gate.e_score_correction_bias"
    if a.shared_expert_dim:
        names.update(shared_w1=p + "shared_experts.gate_proj.weight", shared_w3=p + "shared_experts.up_proj.weight",
                     shared_w2=p + "shared_experts.down_proj.weight")
    return names


def sigmoid_router_fields(c: dict, n_group: int, topk_group: int, routed_scaling_factor: float,
                          first_k_dense_replace: int, n_shared_experts: int) -> dict:
    """ModelArgs fields of the DeepSeek-V3 / GLM-4.5 router, dense layers and shared experts. The keyword
    arguments are the family's HF config defaults: transformers reads a key config.json omits as its default,
    and the families' differ (DeepSeek-V3's 2.5 scaling, 8 groups, 3 dense layers)."""
    given = lambda key, default: 1 if (v := c.get(key, default)) is None else v  # noqa: E731 -- null: one group;
    # 0 is refused with the groups, not read as one
    return dict(router="sigmoid", router_bias=True, n_group=given("n_group", n_group),
                topk_group=given("topk_group", topk_group),
                routed_scaling_factor=float(c.get("routed_scaling_factor", routed_scaling_factor)),
                norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                first_dense_layers=c.get("first_k_dense_replace", first_k_dense_replace) or 0,
                dense_dim=c["intermediate_size"],
                shared_expert_dim=(c.get("n_shared_experts", n_shared_experts) or 0) * c["moe_intermediate_size"],
                shared_expert_gate=False)

