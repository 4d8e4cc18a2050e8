"""Logical rank 2 starts a recovery at step 5 as if its last data-plane call had failed where its peers'
succeeded (a rank dying in the middle of an all-reduce can leave it so): it revokes and waits in the
rebuild, while its peers go on into a vote, an agreement on the communicator it revoked. Nobody died."""
import elastic
from elastic.comm import ProcessFailure

world = elastic.init()
for step in range(10):
    world.fault_point(step)
    try:
        if step == 5 and world.generation == 0 and int(world.logical_rank) == 2:
            raise ProcessFailure("this rank's data-plane call failed; its peers' succeeded")
        world.vote(True)
    except ProcessFailure:
        world.recover()
world.events.emit("result", generation=world.generation, size=world.size)
world.finish()
