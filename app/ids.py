"""Component ids: constants, never strings repeated across files."""

URL = "hs-url"
TEXT = "hs-text"
MODEL = "hs-model"
RUN_BUTTON = "hs-run"
METRIC = "hs-metric"
STATUS = "hs-status"
ERROR = "hs-error"
RUN_INFO = "hs-run-info"
GRID = "hs-grid"
HEATMAP = "hs-heatmap"
STRIP = "hs-strip"
DOWNLOAD = "hs-download"
EXPORT = "hs-export"  # pattern-matching type: {"type": EXPORT, "view": ..., "fmt": ...}

# Flow page
FLOW_TARGET = "hs-flow-target"
FLOW_FUSION = "hs-flow-fusion"
FLOW_SINK = "hs-flow-sink"
FLOW_STRIPS = "hs-flow-strips"
FLOW_LAYERS = "hs-flow-layers"
FLOW_INFO = "hs-flow-info"
QUERY_STORE = "hs-query"
