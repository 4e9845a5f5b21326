"""The AutoSP passes, one per module; their order is in :mod:`autosp_lm.compiler.pipeline`.

Graph passes (Dynamo graph): :mod:`.inline_einops`, :mod:`.fuse_loss_head`, :mod:`.find_sequence`,
:mod:`.shard`.
Joint-graph passes (AOTAutograd joint graph): :mod:`.attention_output_once`,
:mod:`.tag_collectives`, :mod:`.sac` (with its graph facts in :mod:`.sac_graph` and its node
prices in :mod:`.sac_cost`).
"""
