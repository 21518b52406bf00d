"""The one record type every math data set is mapped to."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparse_rl_megatron.rewards.extract import ANSWER_STYLES


@dataclass
class MathRecord:
    """One problem with its gold answer, whatever file it came from."""

    prompt: str
    """The problem text, before any prompt template."""
    answer: str
    """The gold final answer (LaTeX or plain text, no ``$`` delimiters), as the verifier compares it."""
    source_id: str
    """Identifier of the row inside its data set (the file's own id field, else ``L<line>``)."""
    dataset: str
    """Name of the data set (registry name, or the file name for a user file)."""
    answer_style: str = "boxed"
    """How a response's final answer is found: ``boxed`` or ``boxed_or_number`` (GSM8K-style)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other fields worth keeping (worked solution, level, subject, unit, url)."""

    def __post_init__(self) -> None:
        if self.answer_style not in ANSWER_STYLES:
            raise ValueError(
                f"MathRecord.answer_style must be one of {', '.join(ANSWER_STYLES)}, got '{self.answer_style}'"
            )

    def metadata(self) -> dict[str, Any]:
        """What a rollout ``Sample`` carries in its ``metadata`` so the reward can be computed later."""
        return {
            "gold_answer": self.answer,
            "answer_style": self.answer_style,
            "dataset": self.dataset,
            "source_id": self.source_id,
        }
