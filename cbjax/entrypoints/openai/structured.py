"""A request's output constraint from OpenAI's `response_format` or vLLM's `structured_outputs` and older
`guided_*` fields (one per request), checked here so a 400 names the field that holds the problem."""

from __future__ import annotations

from typing import Any

from cbjax.core.structured.guidance import check_constraint
from cbjax.entrypoints.openai.errors import APIError
from cbjax.entrypoints.openai.protocol import SamplingFields
from cbjax.sampling_params import StructuredOutputsParams

# vLLM's older fields, each one kind of StructuredOutputsParams.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint body asks for (None for none); 400 naming the field for a bad one or for two."""
    given: dict[str, Any] = {}
    if body.response_format is not None:
        fields = _response_format_fields(body.response_format)
        if fields is not None:
            given["response_format"] = fields
    if body.structured_outputs is not None:
        given["structured_outputs"] = body.structured_outputs
    given.update((name, {kind: getattr(body, name)}) for name, kind in GUIDED_FIELDS.items()
                 if getattr(body, name) is not None)
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"{', '.join(given)}: each asks for an output constraint and a request takes one; "
                            "send one of them", next(iter(given)))
    (field, fields), = given.items()
    try:
        params = StructuredOutputsParams(**fields)
        check_constraint(params)
    except (TypeError, ValueError) as error:  # TypeError: a key StructuredOutputsParams does not have
        raise APIError(400, f"{field}: {error}", field) from error
    return params


def _response_format_fields(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format as StructuredOutputsParams' fields; None for {"type": "text"}."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                '"schema": {...}} with the schema a JSON object; send one', "response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type must be one of text, json_object, json_schema, got {kind!r}",
                   "response_format")
