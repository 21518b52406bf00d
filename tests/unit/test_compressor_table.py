"""The docs' table of KV compressors is the registry's: one row per registered scorer, what it needs and which
engines run it (an engine runs a scorer when it provides every input the scorer declares)."""
from pathlib import Path

from sglang_ext.config import PLUGIN_PROVIDES
from sparse_rl_megatron.compression.scorers import SCORERS
from sparse_rl_megatron.rollout.kv_cache import PROVIDES as HF_PROVIDES

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
ENGINES = {"`hf`": HF_PROVIDES, "`sglang`": PLUGIN_PROVIDES}


def compressor_table() -> str:
    """The markdown table ``docs/training.md`` shows under "KV compressors"."""
    lines = ["| method | what it keeps | inputs beyond K and V | " + " | ".join(ENGINES) + " |",
             "|" + " --- |" * (3 + len(ENGINES))]
    for name in SCORERS.names():
        scorer = SCORERS.get(name)
        needs = ", ".join(f"`{n}`" for n in sorted(scorer.needs)) or "none"
        runs = ["yes" if scorer.runs_with(provided) else "no" for provided in ENGINES.values()]
        lines.append(f"| `{name}` | {scorer.summary} | {needs} | " + " | ".join(runs) + " |")
    return "\n".join(lines) + "\n"


def test_the_docs_table_of_compressors_is_the_registry():
    expected = compressor_table()
    assert expected in DOC.read_text(), f"docs/training.md's table of KV compressors should read:\n{expected}"
