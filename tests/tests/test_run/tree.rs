//! Issue 12: a three-level tree against the host model (`shaper_common::hierarchy`),
//! packet by packet on random CPUs: verdicts, and which classes count each packet (every
//! level a passed packet went through; only the refusing level for a drop). The root
//! also takes packets of its own through per-CPU credit, so the walk meets a rate word
//! that CPUs charge by chunks.

use super::*;
use shaper_common::hierarchy::{ModelClass, Outcome, TreeModel};

const TREE: [&[&str]; 5] = [
    &[
        "root", "--proto", "udp", "--rate", "20mbit", "--burst", "200k",
    ],
    &[
        "mid", "--parent", "root", "--proto", "udp", "--dport", "9503", "--rate", "8mbit",
        "--burst", "40000", "--ceil", "16mbit", "--cburst", "50000",
    ],
    &[
        "side", "--parent", "root", "--proto", "udp", "--dport", "9504", "--rate", "5mbit",
        "--burst", "30000", "--ceil", "20mbit", "--cburst", "60000",
    ],
    &[
        "leaf", "--parent", "mid", "--proto", "udp", "--dport", "9501", "--rate", "3mbit",
        "--burst", "30000", "--ceil", "10mbit", "--cburst", "40000",
    ],
    &[
        "flows", "--parent", "mid", "--proto", "udp", "--dport", "9502", "--per", "flow", "--rate",
        "2mbit", "--burst", "30000",
    ],
];

const PACKETS: usize = 4000;

#[test]
fn a_three_level_tree_matches_the_model_packet_by_packet() {
    let mut harness = Harness::new(&TREE);
    let configs = harness.attachment.classes().unwrap();
    let mut model = TreeModel::default();
    let ids: HashMap<String, u32> = harness
        .names
        .iter()
        .map(|(id, name)| (name.clone(), *id))
        .collect();
    let names = harness.names.clone();
    let id = |name: &str| ids[name];
    for (&class_id, _) in harness.names.iter() {
        let config: ClassConfig = configs.get(&class_id, 0).unwrap();
        model.classes[class_id as usize] = ModelClass {
            parent: (config.parent != 0).then(|| config.parent as usize - 1),
            rate: config.cost,
            ceil: config.peak_cost,
            per_key: config.scope != shaper_common::Scope::Class as u8,
            ..ModelClass::default()
        };
    }
    let root = id("root") as usize;
    let root_config: ClassConfig = configs.get(&(root as u32), 0).unwrap();
    let chunk = root_config.credit_chunk as u64;
    assert!(
        chunk > 0,
        "the root's own packets go through per-CPU credit"
    );
    let cpus = possible_cpus();
    let mut credit = vec![0u64; cpus];
    let mut flow_words: HashMap<u16, u64> = HashMap::new();
    let mut dice = Lcg(23);
    let mut now = 5_000_000_000u64;
    let mut mismatches = Vec::new();
    let (mut refused, mut borrowed, mut in_debt) = (0, 0, 0);
    // Fair shares learned: how often one rose and fell (hierarchy's fair borrowing).
    let (mut rises, mut falls) = (0, 0);
    for index in 0..PACKETS {
        // About 40 Mbit/s offered against the root's 20; then about 12 to `side` alone,
        // which borrows what the root has spare: the fair shares that overload lowered
        // rise again.
        let overload = index < 2000;
        now += dice.next(if overload { 300_000 } else { 900_000 });
        let cpu = dice.next(cpus as u64) as usize;
        run_on_cpu(cpu);
        let dport = if overload {
            9500 + dice.next(5) as u16
        } else {
            9504
        };
        let sport = 1000 + dice.next(3) as u16;
        let mut datagram = udp(dport, dice.next(1400) as usize);
        datagram.1[..2].copy_from_slice(&sport.to_be_bytes());
        let frame = ipv4(V4::default(), datagram);
        let bytes = frame.len() as u64;
        let name = match dport {
            9501 => "leaf",
            9502 => "flows",
            9503 => "mid",
            9504 => "side",
            _ => "root",
        };
        let class = id(name) as usize;
        // What the model expects: the verdict and the classes that count the packet.
        let (expected, mut counted): (u32, Vec<(String, bool)>) = if class == root {
            let root_words = &mut model.classes[root];
            let verdict = match use_credit(credit[cpu], bytes, chunk) {
                CreditUse::Covered { left } => {
                    credit[cpu] = left;
                    PASS
                }
                CreditUse::Take { first, fallback } => {
                    match [first, fallback].into_iter().find_map(|take| {
                        conform(root_words.rate_tat, now, take, &root_words.rate)
                            .map(|next| (next, take))
                    }) {
                        Some((next, take)) => {
                            root_words.rate_tat = next;
                            credit[cpu] = credit[cpu] + take - bytes;
                            PASS
                        }
                        None => SHOT,
                    }
                }
            };
            (verdict, vec![("root".to_string(), verdict == PASS)])
        } else {
            let key = (name == "flows").then(|| flow_words.entry(sport).or_insert(0));
            let (path, depth) = model.path(class);
            let shares: Vec<u64> = model.classes.iter().map(|c| c.share).collect();
            let outcome = model.admit(class, key, now, bytes);
            for (before, after) in shares.iter().zip(model.classes.iter().map(|c| c.share)) {
                // A share is a cost: lower is larger (0, never learned, is the largest).
                match (*before, after) {
                    (b, a) if a == b => {}
                    (0, _) => falls += 1,
                    (b, a) if a < b => rises += 1,
                    _ => falls += 1,
                }
            }
            match outcome {
                Outcome::Lent { level } => {
                    if level > 0 {
                        borrowed += 1;
                    }
                    if level + 1 < depth {
                        in_debt += 1;
                    }
                    let levels = path[..depth]
                        .iter()
                        .map(|&id| (names[&(id as u32)].clone(), true))
                        .collect();
                    (PASS, levels)
                }
                Outcome::Refused { level } => {
                    refused += 1;
                    (SHOT, vec![(names[&(path[level] as u32)].clone(), false)])
                }
            }
        };
        counted.sort();
        let (verdict, got) = harness.test_run_levels(&frame, &skb_at(now)).unwrap();
        if verdict != expected || got != counted {
            mismatches.push(format!(
                "packet {index} ({name}, {bytes} B at {now} ns on CPU {cpu}): got ({}, {got:?}), model says ({}, {counted:?})",
                verdict as i32, expected as i32
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches[..mismatches.len().min(20)].join("\n")
    );
    println!(
        "{PACKETS} packets through a 3-level tree on {cpus} CPUs: 0 mismatches; {refused} refused, \
         {borrowed} borrowed, {in_debt} charged a level above the lender in debt; fair \
         shares rose {rises} and fell {falls} times"
    );
    assert!(refused > 300 && borrowed > 100 && in_debt > 100);
    assert!(rises > 20 && falls > 20, "fair shares barely moved");
}
