"""
Poor Man's Configurator (nanoGPT's, made strict). Run from a training script as
    exec(open(os.path.join(os.path.dirname(__file__), 'configurator.py')).read())
(next to the script, so that `python path/to/train.py` works from any directory)
after it has defined its settings as plain globals (int, float, bool, str or None). Then
    python train.py config/delta_block_220m.py --batch_size=32 --compile=False
first executes config/delta_block_220m.py, then applies each --key=value in order. Both paths only
accept keys the script defines and values of the same type (an int is fine where a float is expected;
a setting that defaults to None takes anything), so a typo fails loudly instead of being ignored.
A script that reads another script's config files (bench.py and train.py's) sets
_config_file_extras_ok = True to skip the file's settings it does not have.
`--help` prints the script's settings (those between its first two '# ----' lines) with their values and
comments, and exits. Errors are checks.Mistakes, which the scripts print as one line (checks.print_mistakes).
We exec into the script's globals instead of importing a config module: it keeps the script flat and
every setting visible with a single grep, at the price of this small file being a bit unusual.
"""
import builtins as _builtins  # train.py's `compile` setting shadows the builtin
import checks as _checks     # its errors are Mistakes: one line each (checks.print_mistakes)
import os
import sys
from ast import literal_eval
from difflib import get_close_matches


def _check_setting(key, value, known, source):
    if key not in known:
        hint = get_close_matches(key, list(known), n=1)
        raise _checks.InvalidValue(f"unknown config key {key!r} in {source}"
                                   + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    default = known[key]
    ok = (default is None or type(value) is type(default)
          or (type(default) is float and type(value) is int))
    if not ok:
        raise _checks.InvalidValue(f"config key {key!r} in {source} must be {type(default).__name__} "
                         f"(like its value so far, {globals()[key]!r}), got {type(value).__name__} {value!r}")
    return float(value) if type(default) is float else value


def _print_help(script):
    """--help: the script's first docstring paragraph, then its settings as the file lays them out between its first
    two '# ----' lines: the section comments, and each setting with its value now (after any config file and
    --key=value before --help) and its comment."""
    import ast
    import io
    import re
    import tokenize
    with open(script) as f:
        source = f.read()
    print((ast.get_docstring(ast.parse(source)) or '').split('\n\n')[0].strip() + '\n')
    print(f"usage: python {os.path.basename(script)} [config/FILE.py ...] [--key=value ...]   (settings below, "
          f"with their values now)")
    lines = source.splitlines()
    rules = [i for i, line in enumerate(lines) if re.match(r'# -{20,}', line)]
    block = '\n'.join(lines[rules[0] + 1:rules[1]]) + '\n'
    comments = {t.start[0]: t.string.lstrip('#').strip()
                for t in tokenize.generate_tokens(io.StringIO(block).readline) if t.type == tokenize.COMMENT}
    section, last = None, None      # a section is printed with its first setting; `last`: the line printed last
    for n, line in enumerate(block.splitlines(), start=1):
        key = re.match(r'(\w+)\s*=', line)
        if key and key[1] in _known:
            if section:
                print(f"\n{section}")
                section = None
            value = globals()[key[1]]
            shown = value if isinstance(value, str) and value and not re.search(r'\s', value) else repr(value)
            setting = f"  --{key[1]}={shown}"
            print(setting + (' ' * max(1, 40 - len(setting)) + '# ' + comments[n] if n in comments else ''))
            last = n
        elif line.startswith('#'):
            section = comments[n]
        elif line.strip().startswith('#') and last == n - 1:    # a setting's comment, continued
            print(' ' * 40 + '# ' + comments[n])
            last = n
    print('\nA config file is Python that sets these names (config/); --key=value takes a Python literal, or text '
          'for a string setting.')


_known = {k: v for k, v in globals().items()
          if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))}
_help = any(a in ('-h', '--help') for a in sys.argv[1:])
for _arg in (a for a in sys.argv[1:] if a not in ('-h', '--help')):
    if not _arg.startswith('--'):
        # a config file: run it in a scratch namespace (so it may use helpers and exec a shared base),
        # then copy over the settings it made
        print(f"Overriding config with {_arg}")
        _ns = {}
        try:
            with open(_arg) as _f:
                exec(_builtins.compile(_f.read(), _arg, 'exec'), _ns)
        except FileNotFoundError:
            raise _checks.Missing(f"config file {_arg} does not exist") from None
        for _key, _val in _ns.items():
            if not _key.startswith('_') and isinstance(_val, (int, float, bool, str, type(None))):
                if _key not in _known and globals().get('_config_file_extras_ok'):
                    continue  # e.g. bench.py takes a training config's model shape, not its out_dir
                globals()[_key] = _check_setting(_key, _val, _known, _arg)
    else:
        if '=' not in _arg:
            raise _checks.InvalidValue(f"command-line setting {_arg!r} must look like --key=value")
        _key, _val = _arg[2:].split('=', 1)
        if isinstance(_known.get(_key), str):
            _attempt = _val  # strings stay strings: --out_dir=123 is the folder '123'
        else:
            try:
                _attempt = literal_eval(_val)  # numbers, True/False, None
            except (SyntaxError, ValueError):
                _attempt = _val
        globals()[_key] = _check_setting(_key, _attempt, _known, 'the command line')
        print(f"Overriding: {_key} = {globals()[_key]!r}")
if _help:
    _print_help(globals()['__file__'])
    sys.exit(0)
