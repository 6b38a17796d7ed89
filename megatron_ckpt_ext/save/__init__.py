"""The save path's roles, in the order a save uses them: stage (stager choice, staging step),
planner (structure key, cached strategy), write_path (the ordered request transforms), writers
(the writer pool), publish (copies landed), layout (directories, commit, tracker), report."""
