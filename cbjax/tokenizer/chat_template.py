"""Render a model's Jinja chat template the way transformers' `apply_chat_template` does.

Chat templates are untrusted code from model repositories, so they run in jinja2's immutable
sandbox, with the same environment transformers gives them (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`).
"""

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, object]


def render_chat_template(
    template: str, messages: list[Message], add_generation_prompt: bool, **variables: object
) -> str:
    """The prompt text for `messages`; `variables` are the special tokens (`bos_token`, ...) and extras."""
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
