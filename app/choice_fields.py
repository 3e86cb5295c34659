"""Form fields that belong to one choice of a radio: the task suite's fields show only while the suite is
chosen, the needles' only while the needles are. Shown and hidden in the browser (a clientside callback:
no request to the server), so a forged request has nothing to reach; what a field holds while hidden is
read only when its choice is made."""

from __future__ import annotations

import json
from collections.abc import Mapping

from dash import Input, Output, clientside_callback


def show_with_choice(choice_id: str, fields: Mapping[str, str]) -> None:
    """Hide each element of ``fields`` (its id -> the value of the radio ``choice_id`` it belongs to) unless
    the radio has that value. The layout gives each field its ``hidden`` for the radio's first value, so
    nothing shows that does not belong to it while the page loads."""
    values = json.dumps(list(fields.values()))
    # outputs as a list: one array back, however many fields
    clientside_callback(f"(choice) => {values}.map((v) => v !== choice)",
                        [Output(field, "hidden") for field in fields], Input(choice_id, "value"))

