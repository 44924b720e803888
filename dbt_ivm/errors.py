"""A small typed error hierarchy; the adapter turns these into dbt errors."""

from __future__ import annotations

from dataclasses import dataclass


class IvmError(Exception):
    """Base class of every error dbt-ivm raises on purpose."""


class DefinitionChanged(IvmError):
    """A model's definition changed under on_configuration_change 'fail'."""


class IvmConfigError(IvmError):
    """The model's configuration or SQL is invalid: nothing is written."""


@dataclass(frozen=True)
class Reason:
    """Why a query or a refresh cannot take the incremental path.

    ``code`` is stable (tests, run_results and docs refer to it); ``detail``
    names the construct; ``hint`` says what the user can do about it.
    """

    code: str
    detail: str
    hint: str = ""
    where: str = ""  # the construct's place in the model's SQL ("line 3, column 12"), where known

    def message(self) -> str:
        text = f"{self.code}: {self.detail}"
        return f"{text} ({self.hint})" if self.hint else text


class UnsupportedQuery(IvmError):
    """The query cannot be maintained incrementally; carries typed reasons."""

    def __init__(self, reasons: list[Reason]):
        self.reasons = reasons
        super().__init__("; ".join(r.message() for r in reasons))

    @property
    def reason(self) -> Reason:
        return self.reasons[0]
