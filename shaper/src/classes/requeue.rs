//! An ifb deleted behind shaper's back takes the HTB queues of the ingress shape classes
//! with it, and what the program redirects to its old ifindex is lost. Requeueing makes
//! the ifb again and puts each such class's queue back on it, in place: ids, rules,
//! buckets and counters are kept, and a tree keeps its shape.

use super::{
    share::at_share,
    split::refresh_split,
    tree::{children_rate, TreeView},
    ClassSpec,
};
use crate::{
    qdisc,
    state::{decode_name, Attachment, Direction},
};
use anyhow::Result;
use shaper_common::Action;

/// The ingress shape classes whose ifb is gone or was made again (another ifindex): what
/// they send there is lost until they are requeued. Ids and names; run in the
/// attachment's namespace.
pub fn stale_queues(attachment: &Attachment) -> Result<Vec<(u32, String)>> {
    if attachment.location.direction != Direction::Ingress {
        return Ok(Vec::new());
    }
    let ifb = crate::netns::ifindex(&qdisc::ifb_name(&attachment.location.dev)).ok();
    let configs = attachment.classes()?;
    let mut stale = Vec::new();
    for (id, meta) in attachment.class_list()? {
        let config = configs.get(&id, 0)?;
        // On ingress a shape class's mask is the ifindex of the ifb it queues on.
        let queued_on = config.action_mask;
        if config.action == Action::Shape as u8 && queued_on != 0 && Some(queued_on) != ifb {
            stale.push((id, decode_name(&meta.name)));
        }
    }
    Ok(stale)
}

/// Queues the classes of [`stale_queues`] on the ifb as it is now (made if missing),
/// parents first; their names (none: nothing was stale). Run in the attachment's
/// namespace.
pub fn requeue(attachment: &Attachment) -> Result<Vec<String>> {
    let mut stale = stale_queues(attachment)?;
    if stale.is_empty() {
        return Ok(Vec::new());
    }
    let ifb = qdisc::ensure_ifb(&attachment.location.dev)?;
    refresh_split(attachment)?;
    let queue_dev = attachment.location.queue_dev();
    qdisc::ensure_root(&queue_dev, false)?;
    let tree = TreeView::read(attachment, &attachment.class_list()?)?;
    stale.sort_by_key(|(id, _)| tree.depth_of(Some(*id)));
    let (mut configs, metas) = (attachment.classes()?, attachment.meta()?);
    for (id, _) in &stale {
        let mut config = configs.get(id, 0)?;
        let mut spec = ClassSpec::from_meta(&metas.get(id, 0)?, &config);
        if config.global != 0 {
            // This host's share of a global limit, as when it was added.
            spec = at_share(&spec, &attachment.shares()?.get(id, 0)?);
        }
        let parent = tree.classes.get(id).and_then(|node| node.parent);
        let htb = spec.htb_class(parent, children_rate(&tree, *id));
        qdisc::set_class(&queue_dev, *id, &htb, true)?;
        config.action_mask = ifb;
        configs.set(*id, config, 0)?;
    }
    Ok(stale.into_iter().map(|(_, name)| name).collect())
}
