"""Convert an HF checkpoint to GGUF with llama.cpp's own converter (from the llama-cpp-python
sdist), for the llama.cpp side of benchmarks/decode.py.

    python benchmarks/to_gguf.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf [--outtype f32]

LLAMA_CPP_DIR is the sdist's vendor/llama.cpp. The converter identifies known BPE
pre-tokenizers by a hash of their output; a locally trained byte-level BPE is not in its list,
and its pre-tokenization is GPT-2's, so that is what we tell it.
"""
import sys
from pathlib import Path

llama_dir = Path(sys.argv[1])
sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
import conversion.base as base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], *sys.argv[4:]]
import runpy  # noqa: E402

runpy.run_path(str(llama_dir / "convert_hf_to_gguf.py"), run_name="__main__")
