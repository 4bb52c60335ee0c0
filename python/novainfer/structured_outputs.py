"""Constraints on generated text (vLLM's ``StructuredOutputsParams``).

    from novainfer import LLM, SamplingParams, StructuredOutputsParams
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

Set exactly one field. The output is masked token by token (llguidance), so it always
matches, whatever the model or temperature; generation ends (``finish_reason="stop"``) as soon
as the constraint is complete, and a cut output has ``finish_reason="length"``.
JSON is generated without free whitespace (``{"a":1}``) unless the schema sets its own
``"x-guidance"`` options. A constraint that cannot compile raises ``InvalidParameterError``
(``param="structured_outputs"``) when the request is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint; set exactly one field.

    Attributes:
        json: a JSON Schema (a ``dict`` or its JSON text); the output is one JSON value valid
            against it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in llguidance's Lark dialect (rule ``start``).
        json_object: ``True``: the output is any JSON object.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
