"""Form fields that belong to one choice of a radio: the task suite's fields show only while the suite is
chosen, the needles' only while the needles are, and a field both share starts from the chosen one's
default. Done in the browser (clientside callbacks: no request to the server), so a forged request has
nothing to reach; what a field holds while hidden is read only when its choice is made."""

from __future__ import annotations

import json
from collections.abc import Mapping

from dash import Input, Output, State, clientside_callback


def show_with_choice(choice_id: str, fields: Mapping[str, str]) -> None:
    """Hide each element of ``fields`` (its id -> the value of the radio ``choice_id`` it belongs to) unless
    the radio has that value. The layout gives each field its ``hidden`` for the radio's first value, so
    nothing shows that does not belong to it while the page loads."""
    values = json.dumps(list(fields.values()))
    # outputs as a list: one array back, however many fields
    clientside_callback(f"(choice) => {values}.map((v) => v !== choice)",
                        [Output(field, "hidden") for field in fields], Input(choice_id, "value"))



def default_with_choice(choice_id: str, field_id: str, defaults: Mapping[str, str]) -> None:
    """When the radio ``choice_id`` changes, give ``field_id`` the new choice's default (``defaults``: choice
    value -> the field's default for it) if it still holds another choice's default: the needles' lengths
    (512) become the task suite's shortest (1,024) and back, while a value the user typed is kept."""
    table = json.dumps(dict(defaults))
    clientside_callback(
        f"""(choice, value) => {{
            const defaults = {table};
            const given = Object.values(defaults).includes(value);
            return choice in defaults && given && value !== defaults[choice]
                ? defaults[choice] : window.dash_clientside.no_update;
        }}""",
        Output(field_id, "value", allow_duplicate=True), Input(choice_id, "value"), State(field_id, "value"),
        prevent_initial_call=True)
