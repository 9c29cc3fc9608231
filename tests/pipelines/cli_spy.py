"""The generation CLI run in the test's process, with a spy on its loader: the components it loaded, to inspect
(the experts, their converted layers). Shared by the architecture tests."""

from pipelines import cli


def run_cli(monkeypatch, argv):
    """Runs ``pipelines.cli`` with ``argv``; asserts exit code 0; returns the components it loaded."""
    seen = []
    load = cli._load

    def spy(*a, **k):
        seen.append(load(*a, **k))
        return seen[-1]

    monkeypatch.setattr(cli, "_load", spy)
    assert cli.main(argv) == 0
    return seen[0]
