"""The names and paths the command line offers before anything heavy loads: `expertcache --help`
and every verb's --help import this module and the verbs' own, never torch or numba. The library
modules that own each name import it from here."""
from pathlib import Path

DATA = Path(__file__).parent / "data"
BUILTIN_MODEL = DATA / "model"
EVAL_TEXT = DATA / "eval.txt"
CALIB_TEXT = DATA / "calib.txt"

MXFP4 = "mxfp4"
DTYPES = ("fp16", "bf16", "fp32", "int8", "int4", MXFP4)  # slow-tier expert formats (engine/quant.py)
SCHEMES = ("asym", "sym")
SLOT_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "int4", "mxfp4")  # fast-tier formats (engine/slots.py)
DENSE_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "int4")  # dense weights (engine/linear.py)
IO_BACKENDS = ("auto", "uring", "threads")  # engine/transfer.py
INITIAL = ("warm", "cold", "auto")  # the cache's residency at a run's start (engine/engine.py, EngineConfig)
PROMPT_ORDERS = ("experts", "tokens")  # how a prompt's prefill meets the cache (engine/engine.py, EngineConfig)
PREDICTORS = ("router-ahead", "quasi-hidden", "estimator", "hybrid", "lookahead")  # engine/predictors.py
SKETCH_RANK, SKETCH_NEURONS = 16, 8  # the lookahead's expert sketches (engine/predictors.py)
# the lookahead's net on top of the router: 512 wide predicted no better (built-in model), at 4x the bytes a call
LOOKAHEAD_WIDTH = 128
BENCH_POLICIES = ("fetch-all", "threshold:tau=0.15", "first-choice", "quality-first", "speed-first", "substitute-all")
