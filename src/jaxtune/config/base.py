"""What every config section shares: the error type and the section base class (unknown keys are errors, frozen;
``null`` on a key that takes no null is the key unset)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A configuration problem; the message names the key or file and says what to do."""


def takes_null(field: FieldInfo) -> bool:
    annotation = field.annotation
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(annotation)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """``key: null`` (``key=null`` on the command line) on a key that takes no null leaves it unset, at its
        default: how a command line takes back a value its config file set (GRPO's ``train.batch_size``)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or takes_null(fields[k])}
