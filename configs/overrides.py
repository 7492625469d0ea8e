"""Command-line overrides of config fields (`--config.model.index_topk=8`) that name no field.

ml_collections applies `--<flag>.<path>=value` when it parses the flag: at definition for the
default config, else while absl parses the command line. A path that does not exist fails
there with a bare `AttributeError: "'pipeline'"` and a traceback through absl. An entry point
defines its config flags with `define_config_file` / `define_config_dict` and runs
`app.run(main, flags_parser=overrides.parse_flags)`, which end such a run (exit status 1) with
one line naming the field and the fields that exist at that level:

  ConfigError: config.mesh.shape.pipeline: unknown field (--config.mesh.shape.pipeline=2);
  known fields: ['data', 'expert', 'fsdp', 'tensor']

A config file that cannot be loaded (a wrong `--config` path) ends the same way, naming the
flag and the file, instead of ml_collections' deferred error (a traceback at the first use of
the config, naming "config_config").
"""

import os
import re
import sys

from absl import app, flags
import ml_collections
from ml_collections import config_flags

from glm5_jax.config import ConfigError

_OVERRIDE = re.compile(r"--?([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z0-9_.]+)(?:=.*)?", re.DOTALL)
_FileParser = config_flags.config_flags.ConfigFileFlagParser
_ErrorConfig = config_flags.config_flags._ErrorConfig  # pylint: disable=protected-access


def unknown_field(name: str, config, argv) -> ConfigError | None:
  """The ConfigError of the first `--<name>.<path>` in `argv` whose path names no field of
  `config` (the flag's config without overrides), or None."""
  for arg in argv[1:]:
    match = _OVERRIDE.fullmatch(arg)
    if not match or match.group(1) != name:
      continue
    node, where = config, name
    for part in match.group(2).split("."):
      if not isinstance(node, (ml_collections.ConfigDict, dict)):
        break
      if part not in node:
        return ConfigError(f"{where}.{part}: unknown field ({arg}); known fields: "
                           f"{sorted(node.keys())}")
      node, where = node[part], f"{where}.{part}"
  return None


def _exit_if_unknown(errors) -> None:
  """Ends the program with the first error of `errors` (an iterable of ConfigError | None)."""
  for error in errors:
    if error is not None:
      sys.stderr.write(f"{type(error).__name__}: {error}\n")
      sys.exit(1)


def _load(path: str):
  """The config of a `--config=path[:arg]` value (None when the file itself fails: that error
  is ml_collections' to report)."""
  try:
    return _FileParser("config").parse(path.strip("'\""))
  except Exception:  # pylint: disable=broad-except
    return None


def _file_value(name: str, argv, default: str) -> str:
  values = [arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith(f"--{name}=")]
  return values[-1] if values else default


def define_config_file(name: str, default: str | None, help_string: str, **kwargs):
  """`config_flags.DEFINE_config_file`; an unknown override of the default config exits with
  its ConfigError (module docstring)."""
  try:
    return config_flags.DEFINE_config_file(name, default, help_string, **kwargs)
  except (AttributeError, KeyError):
    _exit_if_unknown([unknown_field(name, _load(_file_value(name, sys.argv, default or "")),
                                    sys.argv)])
    raise


def define_config_dict(name: str, config, help_string: str, **kwargs):
  """`config_flags.DEFINE_config_dict`, with `define_config_file`'s error."""
  try:
    return config_flags.DEFINE_config_dict(name, config, help_string, **kwargs)
  except (AttributeError, KeyError):
    _exit_if_unknown([unknown_field(name, config, sys.argv)])
    raise


def unloadable_config_file(argv) -> ConfigError | None:
  """The ConfigError of the first `--<flag>=<path>[:arg]` of a config-file flag whose file
  ml_collections cannot load, or None."""
  for arg in argv[1:]:
    match = re.fullmatch(r"--?([A-Za-z_][A-Za-z0-9_]*)=(.*)", arg, re.DOTALL)
    if not match or match.group(1) not in flags.FLAGS:
      continue
    name, value = match.groups()
    path = value.strip("'\"").split(":", 1)[0]
    if not isinstance(flags.FLAGS[name].parser, _FileParser) or os.path.isfile(path):
      continue
    loaded = _FileParser(name).parse(value.strip("'\""))
    if isinstance(loaded, _ErrorConfig):  # the load's IOError, deferred to the config's use
      error = object.__getattribute__(loaded, "_error")
      reason = [line.strip() for line in str(error).splitlines() if line.strip()][-1]
      return ConfigError(f"--{name}={value}: cannot load the config file {path!r} ({reason}; "
                         f"relative paths start at {os.getcwd()})")
  return None


def parse_flags(argv):
  """`app.parse_flags_with_usage`, with an unknown config field or an unloadable config file
  reported as one ConfigError line on stderr and exit status 1 (module docstring)."""
  _exit_if_unknown([unloadable_config_file(argv)])
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError):
    names = {m.group(1) for m in map(_OVERRIDE.fullmatch, argv[1:]) if m} & set(flags.FLAGS)
    for name in sorted(names):
      flag = flags.FLAGS[name]
      if isinstance(flag.parser, _FileParser):
        config = _load(_file_value(name, argv, flag.default_as_str or ""))
      else:
        config = flag.default
      _exit_if_unknown([unknown_field(name, config, argv)])
    raise
