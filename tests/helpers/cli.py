"""Running the command line in-process, and what its tests read back."""

from __future__ import annotations

from treespec import cli

PNG = b"\x89PNG\r\n\x1a\n"  # the first bytes of every PNG file


def run_cli(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``treespec ARGV`` run in this process."""
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(err: str) -> str:
    """The single ``treespec: error:`` line of a failed command (progress bars aside)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one error line, got {lines}"
    assert lines[0].startswith("treespec: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


def pack_timings(monkeypatch, plain_ms, packed_ms):
    """The start-up timing of plain against packed weights, injected: (1-token, 16-token) ms
    each way; the list of measurements made."""
    import treespec.pack_choice as pc

    calls = []

    def measure(runner, packed):
        calls.append(1)
        return pc.PackingTimes((1, 16), tuple(t / 1e3 for t in plain_ms), tuple(t / 1e3 for t in packed_ms),
                               spread=0.02)

    monkeypatch.setattr(pc, "measure_packing", measure)
    return calls
