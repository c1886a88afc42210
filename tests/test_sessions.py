"""gradio's sessions opened lazily (playground/sessions.py): a new session hash costs one component's configuration
at a time, and what gradio reads of the session is what its own constructor would have computed at once."""
import os

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


@pytest.fixture(scope="module")
def demo(tiny_models):
    import app
    from engine import LLM
    from playground import Playground
    pg = Playground(LLM(tiny_models["llama"][0], max_model_len=512))
    yield app.build_app(pg)
    pg.service.shutdown()


def test_a_lazy_session_reads_as_gradios_own(demo):
    from gradio import state_holder

    from playground import sessions
    if not sessions.lighten_sessions():
        pytest.skip("this gradio's SessionState is not the one the patch was checked against: gradio's own runs")
    assert state_holder.SessionState.__init__ is sessions._light_init
    eager = object.__new__(state_holder.SessionState)
    sessions.gradio_init(eager, demo)  # gradio's own: every component's configuration at once
    lazy = state_holder.SessionState(demo)
    assert dict.__len__(lazy.config_values) == 0  # nothing computed on opening
    some = next(iter(eager.config_values))
    assert some in lazy.config_values and lazy.config_values[some] == eager.config_values[some]
    assert dict.__len__(lazy.config_values) == 1  # only what was asked for
    assert list(lazy.components) == list(eager.components)  # all of them, in order, when all are read (a deep link)
    assert list(lazy.config_values) == list(eager.config_values)
    assert len(lazy.config_values) == len(eager.config_values) == len(list(eager.components))
    key = next(k for k, v in eager.config_values.items() if "props" in v)
    lazy._update_value_in_config(key, "a value")  # what gradio does when an event updates a component
    assert lazy.config_values[key]["props"]["value"] == "a value"
    assert 10**9 not in lazy.config_values
    with pytest.raises(KeyError):
        lazy.config_values[10**9]


def test_another_gradio_keeps_its_own_sessions(monkeypatch):
    from gradio import state_holder

    from playground import sessions
    sessions.lighten_sessions()
    monkeypatch.setattr(state_holder.SessionState, "__init__", sessions.gradio_init)
    monkeypatch.setattr(sessions, "KNOWN_INIT", "0" * 16)  # as if gradio's constructor had changed
    assert not sessions.lighten_sessions() and state_holder.SessionState.__init__ is sessions.gradio_init
