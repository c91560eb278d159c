"""How the entry points (train, evaluate, chat, sft, ablate) report a mistake: one short block
per problem on stderr, "did you mean" first, exit status 2; no traceback and no flag dump.

    def main(argv): ...
    if __name__ == "__main__":
        cli.run(main, config_flag=_CONFIG)

Handled: absl flag errors (bad values, unknown flags), `--config.a.b=v` overrides of fields
that do not exist, config files that are missing or raise (file and line of the fault),
app.UsageError, and every error type in EXPECTED (bad configs, run-directory mismatches,
malformed data files) raised by `main`. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

from absl import app, flags

from rstar2_jax.core.checkpoints import BaseMismatch, NotARunError
from rstar2_jax.core.config_types import ConfigValueError, moved_to, section_at
from rstar2_jax.data.jsonl import DataError
from rstar2_jax.core.registry import UnknownNameError

EXPECTED: tuple[type[BaseException], ...] = (app.UsageError, ConfigValueError, DataError, NotARunError,
                                             UnknownNameError, BaseMismatch)
EXIT_USAGE = 2


def fail(message: str, program: str | None = None):
    program = program or os.path.basename(sys.argv[0]).removesuffix(".py")
    if program == "__main__":
        program = "rstar2_jax"
    print(f"error: {message}\n({program} --helpshort lists the flags)", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def run(main, *, config_flag=None, config_type=None, expected: tuple[type[BaseException], ...] = ()):
    """app.run(main) with readable errors. `config_flag`: the holder of a config_flags
    DEFINE_config_file flag, loaded (and its overrides applied) before main runs; `config_type`:
    the Section it describes (RunConfig), to name where a moved setting went."""

    def parse(argv):
        try:
            rest = flags.FLAGS(argv)
        except flags.Error as e:
            if "Error whilst parsing config file" in str(e):  # the file raised: say where, and why
                fail(_config_file_error(e, _config_arg(argv, config_flag), config_type))
            fail(_section_given_a_name(str(e), config_type) or _flag_error(str(e)))
        except Exception as e:  # noqa: BLE001  config_flags loading the file or applying an override
            fail(_unknown_overrides(argv, _config_arg(argv, config_flag), config_type)
                 or _override_error(e, argv, config_type)
                 or _config_file_error(e, _config_arg(argv, config_flag), config_type))
        if config_flag is not None:
            try:
                value = config_flag.value
                if value is not None:
                    value.to_dict  # noqa: B018  (a file that failed to load raises on first attribute access)
            except Exception as e:  # noqa: BLE001  the file failed to load: say where
                fail(_config_file_error(e, _config_filename(config_flag) or _config_arg(argv, config_flag),
                                        config_type))
        return rest

    def guarded(argv):
        try:
            return main(argv)
        except (*EXPECTED, *expected) as e:
            fail(str(e))

    app.run(guarded, flags_parser=parse)


def _config_filename(config_flag) -> str | None:
    from ml_collections import config_flags
    try:
        return config_flags.get_config_filename(flags.FLAGS[config_flag.name])
    except Exception:  # noqa: BLE001  (not a config file flag)
        return None


def _config_arg(argv, config_flag) -> str | None:
    """The value of --config=FILE (or --config FILE) in argv."""
    if config_flag is None:
        return None
    name = f"--{config_flag.name}"
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _flag_error(message: str) -> str:
    # absl: "flag --x=v: <why>"; keep it, drop the FATAL / help lines absl adds
    return message.replace("\n", " ")


# Names researchers type from other codebases, and ours.
_SYNONYMS = {"learning_rate": "lr", "lr_rate": "lr", "num_epochs": "epochs", "batch_size": "batch"}


def _config_paths(config_file: str | None) -> set[str] | None:
    """Every dotted path (sections and leaves) of the config file's get_config(), or None when it
    cannot be had (no file, a file that raises or takes an argument: the other messages say why)."""
    if not config_file:
        return None
    import importlib.util
    path = config_file.split(":", 1)[0]
    try:
        spec = importlib.util.spec_from_file_location("_rstar2_config_for_errors", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        tree = module.get_config().to_dict()
    except Exception:  # noqa: BLE001
        return None
    paths: set[str] = set()

    def walk(node, prefix):
        for key, value in node.items():
            paths.add(prefix + key)
            if isinstance(value, dict):
                walk(value, prefix + key + ".")
    walk(tree, "")
    return paths


def _unknown_overrides(argv, config_file: str | None, config_type=None) -> str | None:
    """Every `--config.a.b=v` whose path is not in the config, at once, each with the path meant:
    a missing prefix (`--config.roc.mode` -> `--config.rl.roc.mode`), a synonym
    (`rl.learning_rate` -> `rl.lr`) or the closest spelling. None when all exist."""
    import difflib
    paths = _config_paths(config_file)
    if paths is None:
        return None
    leaves = sorted(paths)
    problems = []
    for arg in argv[1:]:
        name = arg.split("=", 1)[0]
        if not name.startswith("--config."):
            continue
        dotted = name.removeprefix("--config.")
        if dotted in paths:
            continue
        if config_type is not None and moved_to(config_type, dotted):
            return None  # moved: _override_error says where to
        head, _, last = dotted.rpartition(".")
        candidates = [p for p in leaves if p.endswith("." + dotted)]
        if not candidates and last in _SYNONYMS:
            candidates = [p for p in (f"{head}.{_SYNONYMS[last]}" if head else _SYNONYMS[last],) if p in paths]
        if not candidates:
            candidates = difflib.get_close_matches(dotted, leaves, n=1, cutoff=0.6)
        if not candidates:
            problems.append(f"{name}: no such field in the config")
        else:
            meant = " or ".join(f"--config.{c}" for c in candidates)
            problems.append(f"{name}: no such field; did you mean {meant}?")
    return "\n".join(problems) or None


def _override_error(e: BaseException, argv, config_type=None) -> str | None:
    """`--config.rl.roc.mod=paper` -> '--config.rl.roc.mod: no such field; did you mean --config.rl.roc.mode?'"""
    text = str(e.args[0] if e.args else e).replace("\\'", "'").replace("\\n", "\n").strip("'\"")
    bad = re.match(r"'?([^'\n]+)'?", text)
    suggestion = re.search(r'Did you mean "([^"]+)"', text)
    key = bad.group(1) if bad else None
    for arg in argv[1:]:
        name = arg.split("=", 1)[0]
        if key and config_type is not None and name.startswith("--config.") and name.rsplit(".", 1)[-1] == key:
            new = moved_to(config_type, name.removeprefix("--config."))
            if new:
                return f"{name}: moved; set " + " or ".join(f"--config.{path}" for path in new) + " instead"
        if key and name.startswith("--") and name.rsplit(".", 1)[-1] == key:
            if suggestion:
                return f"{name}: no such field; did you mean {name.rsplit('.', 1)[0]}.{suggestion.group(1)}?"
            return f"{name}: no such field in the config"
    return None


def _selector_at(config_type, dotted: str) -> str | None:
    """The selector of the part-choosing section at `dotted`, or None (not such a section)."""
    section = section_at(config_type, dotted)
    return section.choice_selector() if section is not None else None


def _section_given_a_name(message: str, config_type) -> str | None:
    """`--config.rl.advantage=mean_only` where rl.advantage is a section that chooses a part by
    its selector (it was a name before): the flag to set instead."""
    match = re.match(r"flag --config\.([\w.]+)=(.*?): Failed to parse .* as a ConfigDict", message)
    if not match or config_type is None:
        return None
    selector = _selector_at(config_type, match.group(1))
    if not selector:
        return None
    return (f"--config.{match.group(1)} is a section now: set --config.{match.group(1)}.{selector}={match.group(2)} "
            f"(its own settings: --config.{match.group(1)}.{match.group(2)}.*)")


def _section_assigned_a_name(line: str | None, config_type) -> str | None:
    """`c.rl.advantage = "mean_only"` in a config file, where rl.advantage is a section that
    chooses a part by its selector (it was a name before): what to write instead."""
    match = re.match(r"\s*(\w+)\.([\w.]+)\s*=\s*(.+?)\s*(#.*)?$", line or "")
    if not match or config_type is None:
        return None
    var, dotted, value = match.group(1), match.group(2), match.group(3)
    selector = _selector_at(config_type, dotted)
    if not selector:
        return None
    return (f"{dotted} is a section now: write `{var}.{dotted}.{selector} = {value}` (its own settings under "
            f"{dotted}.<name>.*)")


def _config_file_error(e: BaseException, filename: str | None, config_type=None) -> str:
    """A config file that is missing, or raises while it loads: the file and line of the fault."""
    text = str(e)
    if filename is None:
        match = re.search(r"Attempted \[[^\]]*\]:\s*\n\s*(\S+)", text)
        filename = match.group(1) if match else None
    if filename and not os.path.exists(filename.split(":", 1)[0]):
        return f"--config={filename}: no such file"
    if filename:
        path = os.path.abspath(filename.split(":", 1)[0])
        cause = _load_config_file(path, filename.partition(":")[2], config_type)
        if cause:
            return f"--config={filename}: {cause}"
    return f"--config: {text.splitlines()[0] if text else type(e).__name__}"


def _load_config_file(path: str, arg: str, config_type=None) -> str | None:
    """Run the config file's get_config(arg) to find where it fails: 'file:line: Type: message'."""
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location("_config_under_test", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.get_config(arg) if arg else module.get_config()
    except SyntaxError as e:
        return f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}"
    except Exception as e:  # noqa: BLE001  (whatever the file raises is the user's message)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == path]
        where = f"{path}:{frames[-1].lineno}: " if frames else ""
        hint = _section_assigned_a_name(frames[-1].line, config_type) if frames and isinstance(e, TypeError) else None
        return f"{where}{hint}" if hint else f"{where}{type(e).__name__}: {e}"
    return None


def model_dir(path: str | None, flag: str = "--model") -> str | None:
    """The local directory of a model flag's value: a HF model directory, or a hub id through the
    Hugging Face cache (models/hub.py); a UsageError that says what is missing."""
    if path is None:
        return None
    from rstar2_jax.models.hub import ModelNotFound, model_directory
    try:
        return model_directory(path, flag)
    except ModelNotFound as e:
        raise app.UsageError(str(e)) from None
