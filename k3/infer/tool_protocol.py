"""The request shapes of OpenAI's tool calling and structured output (checked strictly like the rest of
k3.infer.protocol): tools, tool_choice, an assistant's tool_calls, response_format."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallInMessage(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


TOOLS_ALLOWED = {
    "tools": f"a list of at most {MAX_TOOLS} {{\"type\": \"function\", \"function\": {{\"name\": ..., "
             f"\"parameters\": {{JSON schema}}}}}}",
    "tool_choice": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
    "response_format": "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                       "\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
}
