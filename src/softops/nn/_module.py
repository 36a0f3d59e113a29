"""The base of the Modules that hold their arguments (a function's, a layer's): keywords, repr."""

from __future__ import annotations

from typing import Any, ClassVar

import torch


class ArgsModule(torch.nn.Module):
    """Stores the arguments named in ``_fields`` (set, checked, by the subclass's ``__init__``).

    ``_kwargs()`` gives those not in ``_args`` (passed positionally by ``forward``) as keywords;
    the repr lists every field in order, those of ``_optional`` (name, default) pairs only where
    they differ from their default.
    """

    _fields: ClassVar[tuple[str, ...]]
    _args: ClassVar[tuple[str, ...]] = ()
    _optional: ClassVar[tuple[tuple[str, Any], ...]] = ()

    def _kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields if name not in self._args}

    def _repr_value(self, name: str) -> Any:
        return getattr(self, name)

    def extra_repr(self) -> str:
        shown, defaults = [], dict(self._optional)
        for name in self._fields:
            value = self._repr_value(name)
            if name in defaults:
                default = defaults[name]
                if value is None if default is None else value == default:
                    continue
            shown.append(f"{name}={value!r}")
        return ", ".join(shown)
