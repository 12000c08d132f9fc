"""Chat templates: a checkpoint's Jinja template, rendered exactly as transformers renders it.

    template = load_chat_template("path/to/checkpoint")          # or load_chat_template(dir, override="t.jinja")
    text, spans = template.render(messages)                        # spans: [(start, end)] of assistant text

The environment is transformers' (`transformers.utils.chat_template_utils`): a sandbox with
trim_blocks/lstrip_blocks, loop controls, the `{% generation %}` tag, the `tojson` filter and the
`raise_exception`/`strftime_now`/`dict`/`namespace` globals; the special tokens of
tokenizer_config.json are template variables, and message keys whose value is None are dropped.

Assistant spans: with `{% generation %}` markers, the character ranges they enclose (what transformers'
`return_assistant_tokens_mask` uses). Without markers (e.g. Qwen3's template), each assistant turn is
found by rendering the conversation prefix by prefix: it starts where the conversation before it, rendered
with the generation prompt, ends, and it is the text the template writes for that turn.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tptrain.io import read_json

ROLES = ("system", "user", "assistant", "tool", "developer")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _environment():
    """transformers' chat-template environment, with the generation tracker."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tracker(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=_TemplateDict(), namespace=_template_namespace())
    return env


def _generation_tracker() -> type:
    """The `{% generation %}` tag as a jinja2 extension: renders its body and, while `track` is active, records
    the character range it wrote."""
    import jinja2
    import jinja2.ext

    class GenerationTracker(jinja2.ext.Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._blocks = self._spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            if self._blocks is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks = self._spans = None

    return GenerationTracker


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _template_namespace() -> type:
    """jinja2's `namespace`, refusing dunder (any `_`) attributes: no way out of the sandbox."""
    import jinja2

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    return TemplateNamespace


class ChatTemplate:
    """One compiled chat template. `variables`: the special tokens it may read (bos_token, eos_token, ...)."""

    def __init__(self, source: str, *, name: str, variables: dict[str, str] | None = None) -> None:
        import jinja2

        self.source, self.name, self.variables = source, name, dict(variables or {})
        self.has_generation_markers = bool(_GENERATION_TAG.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"chat template {name} is not valid Jinja (line {exc.lineno}): {exc.message}") from None

    def text(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        return self._render(messages, add_generation_prompt, None)

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the character spans of its assistant turns)."""
        if self.has_generation_markers:
            spans: list[tuple[int, int]] = []
            return self._render(messages, False, spans), spans
        text = self.text(messages)
        return text, [self._turn_span(messages, i, text) for i, m in enumerate(messages) if m["role"] == "assistant"]

    def _render(self, messages, add_generation_prompt: bool, spans: list | None) -> str:
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        kwargs = {**self.variables, "messages": messages, "tools": None, "documents": None,
                  "add_generation_prompt": add_generation_prompt}
        if spans is None:
            return self._template.render(**kwargs)
        blocks: list[str] = []
        with self._template.environment.track_generation(blocks, spans):
            for block in self._template.generate(**kwargs):
                blocks.append(block)
        return "".join(blocks)

    def _turn_span(self, messages, i: int, text: str) -> tuple[int, int]:
        """Assistant turn i of `text`: it starts after the prefix rendered with the generation prompt and is the
        text the template writes for that turn when it ends the conversation; a template that writes a final
        turn with more in front (Qwen3's empty think block) keeps the longest tail of it found in `text`."""
        before = self.text(messages[:i], add_generation_prompt=True)
        through = self.text(messages[:i + 1])
        if not text.startswith(before) or not through.startswith(before):
            raise ValueError(f"chat template {self.name}: the conversation up to message {i} rendered with the "
                             "generation prompt is not a prefix of the whole conversation, so its assistant turn "
                             "cannot be located; use a template with {% generation %} markers (--chat-template "
                             "FILE) or --no-assistant-only-loss")
        start, turn = len(before), through[len(before):]
        for cut in range(len(turn)):
            if text.startswith(turn[cut:], start):
                return start, start + len(turn) - cut
        return start, start


def load_chat_template(model_dir: str | Path | None, override: str | Path | None = None) -> ChatTemplate:
    """The chat template of a checkpoint: `override` (a .jinja file) first, then `chat_template` in
    tokenizer_config.json (a string, or a list of {"name", "template"}: the "default" one), then
    chat_template.jinja. ValueError naming the fix when there is none."""
    directory = Path(model_dir) if model_dir is not None else None
    config_path = directory / "tokenizer_config.json" if directory is not None else None
    config = read_json(config_path) if config_path and config_path.is_file() else {}
    variables = _special_tokens(config)
    if override is not None:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {path} does not exist; pass a Jinja file")
        return ChatTemplate(path.read_text(encoding="utf-8"), name=str(path), variables=variables)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str):
        return ChatTemplate(source, name=str(config_path), variables=variables)
    jinja = directory / "chat_template.jinja" if directory is not None else None
    if jinja is not None and jinja.is_file():
        return ChatTemplate(jinja.read_text(encoding="utf-8"), name=str(jinja), variables=variables)
    raise ValueError(f"the checkpoint {directory} has no chat template (no chat_template in tokenizer_config.json, "
                     "no chat_template.jinja), so 'messages' records cannot be rendered; pass one with "
                     "--chat-template FILE (Trainer(chat_template=FILE)), or give the data as 'text' or "
                     "'prompt'/'completion' records")


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """tokenizer_config.json's special tokens as template variables (transformers' special_tokens_map)."""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out
