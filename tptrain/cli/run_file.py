"""`tptrain train --config run.yaml`: a run file, every option of `tptrain train` as a key.

    # run.yaml (TOML works too: run.toml)
    model: Qwen/Qwen3-0.6B
    data: my.jsonl
    tp-size: 2            # the flag's name without the dashes; tp_size works too
    max-steps: 1000
    lr: 3.0e-4
    bf16: true            # a switch (--bf16) takes true / false

    tptrain train --config run.yaml --max-steps 50    # a flag given on the command line overrides the file
    tptrain train --config run.yaml --print-config    # every option's final value, as a run file; exits 0

The launcher checks the file (unknown keys, named with the closest option; wrong types, named with the type
expected) before anything else, and saves the resolved configuration as `<output-dir>/run_config.yaml`, which
`--config` reads back to the same run. Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import copy
import difflib
import os
import sys
from pathlib import Path
from typing import Any, Sequence

RUN_CONFIG = "run_config.yaml"  # the resolved configuration, saved in --output-dir
_COMMAND_LINE_ONLY = ("help", "config", "print_config")  # flags a run file cannot set (it cannot name another)


def train_parser(workflow: str = "train") -> argparse.ArgumentParser:
    """A parser of `tptrain train`'s flags alone (its options and sections), or `tptrain dpo`'s ("dpo")."""
    from tptrain.cli.dpo import add_dpo_arguments
    from tptrain.cli.train_arguments import add_train_arguments

    parser = argparse.ArgumentParser(prog=f"tptrain {workflow}")
    (add_dpo_arguments if workflow == "dpo" else add_train_arguments)(parser)
    return parser


def apply_run_file(args: argparse.Namespace, argv: Sequence[str] | None) -> argparse.Namespace:
    """`args` with the run file's values (args.config) wherever the command line `argv` (the arguments after
    `train`) gives no flag. Raises OSError / ValueError naming the file and key."""
    if args.config is None:
        return args
    if argv is None:
        raise ValueError("--config: the run file's values yield to the flags given on the command line, so "
                         "run_train needs that command line (argv) too")
    parser = train_parser(getattr(args, "workflow", "train"))
    parser.set_defaults(**read_run_file(args.config, parser))
    merged = parser.parse_args(list(argv))
    for name, value in vars(args).items():  # what is not a flag (the command's handler)
        if not hasattr(merged, name):
            setattr(merged, name, value)
    return merged


def read_run_file(path: str | os.PathLike, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """{dest: value} of a YAML or TOML (*.toml) run file, each key an option of `parser` and each value of its type."""
    raw = _load(Path(path))
    values, keys = {}, _options(parser)
    for key, value in raw.items():
        name = str(key).replace("_", "-")
        if name.replace("-", "_") in _COMMAND_LINE_ONLY:
            raise ValueError(f"--config {path}: '{key}' is a command-line flag only, not a run file's key")
        if name not in keys:
            close = difflib.get_close_matches(name, list(keys), n=1)
            hint = f"did you mean '{close[0]}'?" if close else "`tptrain train --help` lists the options"
            raise ValueError(f"--config {path}: unknown key '{key}'; {hint}")
        action = keys[name]
        if action.dest in values:
            raise ValueError(f"--config {path}: '{key}' sets {name}, which the file sets already; keep one")
        values[action.dest] = _value(action, name, value, path)
    return values


def resolved_config(args: argparse.Namespace) -> dict[str, Any]:
    """{option name: value} for every option of `tptrain train` (or `tptrain dpo`): what `--print-config` prints."""
    return {name: getattr(args, action.dest)
            for name, action in _options(train_parser(getattr(args, "workflow", "train"))).items()}


def dump(config: dict[str, Any]) -> str:
    """`config` as a run file: YAML, the options in `tptrain train --help`'s sections and order."""
    import yaml

    class Dumper(yaml.SafeDumper):  # a string with line breaks in one line, as "...\n..."
        def represent_str(self, text: str):
            return self.represent_scalar("tag:yaml.org,2002:str", text, style='"' if "\n" in text else None)

    Dumper.add_representer(str, Dumper.represent_str)
    parser = train_parser()
    command = "train" if set(config) <= set(_options(parser)) else "dpo"  # a preference run's options: tptrain dpo
    parser = parser if command == "train" else train_parser(command)
    lines = [f"# tptrain {command}'s resolved configuration: `tptrain {command} --config THIS_FILE` runs it again"]
    for title, names in _sections(parser):
        section = {name: config[name] for name in names if name in config}
        if section:
            lines += [f"# {title}", yaml.dump(section, Dumper=Dumper, sort_keys=False, allow_unicode=True,
                                              width=1 << 16)]
    return "\n".join(lines)


def save_run_config(config: dict[str, Any], output_dir: str | os.PathLike) -> Path:
    """Write `dump(config)` to output_dir/run_config.yaml atomically (a reader sees the old file or the new)."""
    path = Path(output_dir) / RUN_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_CONFIG}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(dump(config))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------ reading and checking


def _load(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise OSError(f"--config {path}: cannot read the run file ({exc.strerror or exc})") from None
    if path.suffix == ".toml":
        data = _toml(path, text)
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"--config {path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if data is None:  # an empty file
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a run file maps options to values (e.g. `max-steps: 300`), got a "
                         f"{type(data).__name__}")
    return data


def _toml(path: Path, text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(f"--config {path}: reading TOML needs Python 3.11 or later (tomllib), or `pip install "
                             "tomli`; or write the run file as YAML") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message names the line and column
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None


def _value(action: argparse.Action, name: str, value: Any, path: str | os.PathLike) -> Any:
    """`value` as the option's own type (what its flag would give), or a ValueError naming the type expected."""
    given = value

    def wrong(expected: str) -> ValueError:
        return ValueError(f"--config {path}: {name} must be {expected}, got {given!r} ({type(given).__name__})")

    if value is None and action.default is None:  # null: the option's default (unset)
        return None
    if action.nargs == 0:  # a switch: --bf16, --packing / --no-packing
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if action.nargs == "+":  # a list (--loss-type sigmoid sft): a list of the option's values, or one value
        items = value if isinstance(value, list) else [value]
        if not items:
            raise wrong("a non-empty list")
        one = copy.copy(action)
        one.nargs = None
        return [_value(one, name, item, path) for item in items]
    if action.nargs == "?":  # --resume [CHECKPOINT]: true (the latest), false / null (none) or a path
        if value is True:
            return action.const
        if value is False or isinstance(value, str):
            return value or None
        raise wrong(f"true or a path ({action.metavar})")
    if action.type is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise wrong("an integer")
    elif action.type is float:
        try:  # YAML reads 3e-4 (no dot) as a string: what --lr 3e-4 would parse is accepted
            value = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
        except ValueError:
            value = None
        if value is None:
            raise wrong("a number")
    elif not isinstance(value, str):
        raise wrong("a string (quote it in YAML: \"...\")")
    elif callable(action.type):  # a flag's own conversion (--dtype bf16 -> bfloat16), as on the command line
        try:
            value = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            pass  # the choices below name what it takes
    if action.choices is not None and value not in action.choices:
        raise wrong(f"one of {', '.join(map(repr, action.choices))}")
    return value


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{name: action}: each option under its long flag without the dashes (max-steps), in --help's order."""
    table = {}
    for action in parser._actions:  # argparse has no public list of its options
        if action.dest not in _COMMAND_LINE_ONLY and action.option_strings:
            table[action.option_strings[0].removeprefix("--")] = action
    return table


def _sections(parser: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    """(--help section, its option names), in --help's order."""
    names = {action: name for name, action in _options(parser).items()}
    return [(group.title, [names[a] for a in group._group_actions if a in names]) for group in parser._action_groups]
