"""Planning: what a step holds, layer by layer (footprint), how a pipeline cuts the decoder (stages), and measuring
what a step really holds (measure). Nothing here loads weights; the run path (qft.run, qft.pipeline) and the tools
(qft.tools.memory, the dry-run launcher) read it."""
