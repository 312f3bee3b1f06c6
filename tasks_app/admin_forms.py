"""The admin's model form that answers only for the fields it shows (list rows, read-only parts)."""

from typing import Any

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError


class ShownFieldsForm(forms.ModelForm):
    """A model form that leaves out the row's errors on fields it does not show."""

    # The field whose presence makes the row's own errors ("__all__") this form's; None: always.
    non_field_errors_with: str | None = None

    def add_error(self, field: str | None, error: Any) -> None:
        """Add `error`, leaving out the row's errors on fields this form does not show."""
        if field is None and isinstance(error, ValidationError) and hasattr(error, "error_dict"):
            owner = self.non_field_errors_with
            shown = {
                name: errors
                for name, errors in error.error_dict.items()
                if name in self.fields or (name == NON_FIELD_ERRORS and (owner is None or owner in self.fields))
            }
            if not shown:
                return
            error = shown
        super().add_error(field, error)
