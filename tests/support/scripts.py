"""The benchmark scripts as their users run them: argument errors in process (the subprocess
cases are in each script's own smoke test)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest


def refusal(main: Callable[[Sequence[str]], object], argv: Sequence[str],
            capsys: pytest.CaptureFixture[str]) -> str:
    """What a script's ``main(argv)`` printed when it refused ``argv`` (it must exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err
