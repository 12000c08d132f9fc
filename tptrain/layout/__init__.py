"""The one layout of a job: the size of every parallel axis (`ParallelDims`) and the one rule table that decides
which sizes, axes and features compose (`validate`). Pure: importing it imports no torch, so the CLI checks a layout
before it loads anything heavy. The mesh of a ParallelDims is built by tptrain/distributed/topology.py."""
from tptrain.layout.case import LIBRARY, Case, Features, ModelFacts, Rule, Spelling
from tptrain.layout.dims import EP_MESH_AXES, MESH_AXES, PP_AXIS, Asked, ParallelDims
from tptrain.layout.rules import RULES, case_of, check, parse_layout, refusals, resolve, validate

__all__ = ["EP_MESH_AXES", "LIBRARY", "MESH_AXES", "PP_AXIS", "RULES", "Asked", "Case", "Features", "ModelFacts",
           "ParallelDims", "Rule", "Spelling", "case_of", "check", "parse_layout", "refusals", "resolve", "validate"]
