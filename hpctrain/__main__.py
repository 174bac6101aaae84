"""``python -m hpctrain ...``: the same as the ``hpctrain`` command."""

from .cli import command

command()
