"""The ``aotpack`` group: each verb parses its options and calls the stage, review or verify
function that does the work; what they print about bundles is in ``aot.cli.reports``.

The verbs live by what they do to a bundle: ``aot.cli.build`` makes and reviews one,
``aot.cli.run`` runs one, ``aot.cli.ship`` signs, inspects and serves one."""

from __future__ import annotations

import click

from aot.cli import build, run, ship


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="aotpack")
def cli() -> None:
    """Ahead-of-time packaging of PyTorch models: build a bundle, load it, review its guards."""


for _verb in (
    build.build,
    run.load,
    build.guards,
    build.diff_command,
    build.stale_manifest_command,
    ship.keygen,
    ship.sign,
    ship.inspect,
    run.tune,
    run.verify,
    run.generate_tokens,
    ship.serve,
    ship.triton_repo,
):
    cli.add_command(_verb)
