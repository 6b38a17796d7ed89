"""The save path's roles, each a module the Checkpointer facade asks: the on-disk layout and
commit (layout), the structure key and cached strategy (planner), the save record and its report
(report). Nothing here imports the facade."""
