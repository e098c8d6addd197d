"""The phases of a build, on every rank, in the order :func:`tokenloom.builder.runner.run` calls them.

Each phase is a function of the build's :class:`tokenloom.builder.context.BuildContext`, in a
module of its own:

First **resolve** (:mod:`.resolve`): the config's epoch budgets become sample counts (each
budgeted store's ``.idx`` read), and the ranks agree that every one of them could. Then:

0. **warm start** (:mod:`.fingerprint`) -- when the last build of this config kept its plan and
   every rank proves its share of the stores unchanged (:mod:`tokenloom.builder.starts`), the
   ranks take that plan and skip 1 and most of 2;
1. **fingerprint** (:mod:`.fingerprint`) -- ranks fingerprint the stores round-robin (a store
   unchanged since the memo recorded it is not opened: :mod:`tokenloom.builder.stores`), make
   those stores' dataset items, and gather both;
   **pack** (:mod:`.pack`; ``packing: best_fit`` only) -- the chunks of every split's documents
   that no writer's cache holds are packed and published, divided over the ranks by longest
   processing time first; the ranks gather every chunk's sample count, which the plan needs
   (:mod:`tokenloom.builder.best_fit`);
2. **plan** (:mod:`.plan`) -- every rank resolves the same items and keys from the gathered ones,
   the writers check their cache, and all ranks agree on what is missing; missing items go to
   ranks by longest processing time first, exact blends are cut into one range per rank;
3. **build** (:mod:`.build_items`) -- each rank builds its items (locks per item, atomic
   publication);
4. **transfer** (:mod:`.transfer`) -- without a shared filesystem, each finished item travels over
   the group to one writer per node that lacks it;
5. **finalize** (:mod:`.finalize`) -- writers record the manifest (and the megatron-core cache)
   and keep the plan for the next start; every rank opens the result by mmap.

Each phase ends with :func:`tokenloom.builder.collective.agree`: statuses are gathered before anything
else happens, and a failure anywhere raises the same BuildError on every rank. (The build's
measured work rides on its agreement, and opening the result shares finalize's: a collective
costs every rank CPU time, most of all when ranks outnumber cores.)
"""
