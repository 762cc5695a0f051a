"""pytest's assertion explanations in ranks: a failing ``assert a == b`` explains itself
through pytest's own ``pytest_assertrepr_compare`` with the launcher's settings (a
conftest's own hook is not consulted in ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

#: The ini values pytest's explanations read (those this pytest knows are shipped).
_INI = ("truncation_limit_lines", "truncation_limit_chars", "assertion_text_diff_style")


@dataclass(frozen=True)
class AssertionSettings:
    """What pytest's explanations of a comparison depend on, from the launcher's config."""

    verbosity: int
    assertmode: str
    ini: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Any) -> AssertionSettings:
        ini = {}
        for name in _INI:
            try:
                ini[name] = config.getini(name)
            except ValueError:  # an older pytest without this setting
                continue
        # pytest < 8 has one verbosity (-v) and no get_verbosity.
        get = getattr(config, "get_verbosity", None)
        return cls(
            verbosity=get(config.VERBOSITY_ASSERTIONS) if get else int(config.getoption("verbose")),
            assertmode=str(config.getvalue("assertmode")),
            ini=ini,
        )

    # The part of pytest's Config its assertion hook reads.
    def get_verbosity(self, verbosity_type: str | None = None) -> int:
        return self.verbosity

    def getini(self, name: str) -> Any:
        return self.ini[name]

    def getvalue(self, name: str) -> Any:
        return {"assertmode": self.assertmode, "verbose": self.verbosity}[name]

    getoption = getvalue
    # No terminal reporter here: explanations stay plain text (no colour codes).
    pluginmanager = SimpleNamespace(has_plugin=lambda name: False)


def install(settings: AssertionSettings) -> None:
    """Explain this rank's failing comparisons as pytest would in the launcher (a
    comparison its hook cannot explain here keeps its one-line message)."""
    from _pytest import assertion
    from _pytest.assertion import util

    def reprcompare(op: str, left: object, right: object) -> str | None:
        try:
            hook = assertion.pytest_assertrepr_compare
            lines = list(hook(config=settings, op=op, left=left, right=right) or ())
        except Exception:  # another pytest's internals: the one-line message
            return None
        if not lines:
            return None
        # As pytest's own callbinrepr prepares a hook result for format_explanation.
        text = "\n~".join(line.replace("\n", "\\n") for line in lines)
        return text.replace("%", "%%") if settings.assertmode == "rewrite" else text

    util._reprcompare = reprcompare
    util._config = settings
