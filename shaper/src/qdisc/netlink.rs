//! shaper's qdiscs and HTB classes over rtnetlink: netlink-packet-route's tc messages on
//! a netlink-sys socket, no process per object. The messages of one change go to the
//! kernel together (as many per send as fit a datagram) and every one is acknowledged;
//! a refusal reads as one line naming the device, the object and what the kernel said.
//! The crate has no HTB or fifo options: `options` encodes them.

use crate::error::runtime;
use anyhow::Result;
use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CAPPED, NLM_F_CREATE,
    NLM_F_ECHO, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST,
};
use netlink_packet_route::{
    tc::{TcAttribute, TcHandle, TcHeader, TcMessage},
    RouteNetlinkMessage,
};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use std::cell::RefCell;
use std::os::unix::fs::MetadataExt as _;

mod options;
use options::htb_class;
pub(crate) use options::{bfifo, htb_root, plain, HtbClassOptions};

/// One tc request and what it does, for errors ("add HTB class 5348:3 on dm0").
pub(crate) struct Request {
    message: RouteNetlinkMessage,
    flags: u16,
    what: String,
    /// The errors that mean the object is not there: for a delete, done already (ENOENT,
    /// or ENODEV: the device took it); for a GET, none to read.
    absent: &'static [i32],
}

pub(super) fn handle_text(handle: u32) -> String {
    format!("{:x}:{:x}", handle >> 16, handle & 0xffff)
}

fn tc_message(ifindex: u32, parent: u32, handle: u32, attributes: Vec<TcAttribute>) -> TcMessage {
    let header = TcHeader {
        index: ifindex as i32,
        parent: TcHandle::from(parent),
        handle: TcHandle::from(handle),
        ..Default::default()
    };
    TcMessage::from_parts(header, attributes)
}

const GONE: &[i32] = &[nix::libc::ENOENT, nix::libc::ENODEV];
const NOT_FOUND: &[i32] = &[nix::libc::ENOENT];

/// The parent handle of a root qdisc (TC_H_ROOT).
pub(crate) const ROOT: u32 = u32::MAX;

impl Request {
    /// Adds (`create`) or changes HTB class `classid` under `parent`.
    pub(crate) fn htb_class(
        dev: &str,
        ifindex: u32,
        (parent, classid): (u32, u32),
        options: &HtbClassOptions,
        create: bool,
    ) -> Self {
        let attributes = vec![
            TcAttribute::Kind("htb".into()),
            TcAttribute::Options(htb_class(options)),
        ];
        let (verb, flags) = if create {
            ("add", NLM_F_CREATE | NLM_F_EXCL)
        } else {
            ("change", 0)
        };
        Self {
            message: RouteNetlinkMessage::NewTrafficClass(tc_message(
                ifindex, parent, classid, attributes,
            )),
            flags,
            what: format!("{verb} HTB class {} on {dev}", handle_text(classid)),
            absent: &[],
        }
    }

    /// Deletes class `classid` (with its leaf qdisc).
    pub(crate) fn delete_class(dev: &str, ifindex: u32, classid: u32) -> Self {
        Self {
            message: RouteNetlinkMessage::DelTrafficClass(tc_message(ifindex, 0, classid, vec![])),
            flags: 0,
            what: format!("delete HTB class {} on {dev}", handle_text(classid)),
            absent: GONE,
        }
    }

    /// Makes the qdisc under `parent` the one `attributes` describe: changed in place when
    /// one of the same kind is there (its queue kept), made and grafted otherwise (tc's
    /// `qdisc replace`).
    pub(crate) fn replace_qdisc(
        dev: &str,
        ifindex: u32,
        (parent, handle): (u32, u32),
        attributes: Vec<TcAttribute>,
    ) -> Self {
        let kind = attributes
            .iter()
            .find_map(|attribute| match attribute {
                TcAttribute::Kind(kind) => Some(kind.clone()),
                _ => None,
            })
            .unwrap_or_default();
        let place = if parent == ROOT {
            "root".to_string()
        } else {
            format!("under {}", handle_text(parent))
        };
        Self {
            message: RouteNetlinkMessage::NewQueueDiscipline(tc_message(
                ifindex, parent, handle, attributes,
            )),
            flags: NLM_F_CREATE | NLM_F_REPLACE,
            what: format!("set the {kind} qdisc {place} on {dev}"),
            absent: &[],
        }
    }

    /// Deletes the root qdisc (the kernel's default comes back).
    pub(crate) fn delete_root(dev: &str, ifindex: u32) -> Self {
        Self {
            message: RouteNetlinkMessage::DelQueueDiscipline(tc_message(ifindex, ROOT, 0, vec![])),
            flags: 0,
            what: format!("delete the root qdisc on {dev}"),
            absent: GONE,
        }
    }

    /// Reads the root qdisc. (A GET is answered with the object only when it asks for an
    /// echo on kernels that skip notifications nobody listens to, 6.18 here.)
    pub(crate) fn get_root(dev: &str, ifindex: u32) -> Self {
        Self {
            message: RouteNetlinkMessage::GetQueueDiscipline(tc_message(ifindex, ROOT, 0, vec![])),
            flags: NLM_F_ECHO,
            what: format!("read the root qdisc of {dev}"),
            absent: NOT_FOUND,
        }
    }

    /// Reads class `classid`.
    pub(crate) fn get_class(dev: &str, ifindex: u32, classid: u32) -> Self {
        Self {
            message: RouteNetlinkMessage::GetTrafficClass(tc_message(ifindex, 0, classid, vec![])),
            flags: NLM_F_ECHO,
            what: format!("read HTB class {} on {dev}", handle_text(classid)),
            absent: NOT_FOUND,
        }
    }
}

/// A route socket in the namespace it was opened in, and its next sequence number.
struct Connection {
    netns: u64,
    socket: Socket,
    sequence: u32,
}

thread_local! {
    /// One socket per thread, opened again when the thread moves to another namespace.
    static CONNECTION: RefCell<Option<Connection>> = const { RefCell::new(None) };
}

/// The inode of this thread's network namespace.
fn this_netns() -> Result<u64> {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|metadata| metadata.ino())
        .map_err(|error| {
            runtime(format!(
                "cannot read this thread's network namespace: {error}"
            ))
        })
}

fn open() -> std::io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    // Errors echo only the request's header, with the kernel's reason in words.
    let _ = socket.set_cap_ack(true);
    let _ = socket.set_ext_ack(true);
    Ok(socket)
}

fn with_connection<T>(work: impl FnOnce(&mut Connection) -> Result<T>) -> Result<T> {
    let netns = this_netns()?;
    CONNECTION.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot
            .as_ref()
            .is_none_or(|connection| connection.netns != netns)
        {
            let socket = open()
                .map_err(|error| runtime(format!("cannot open a route netlink socket: {error}")))?;
            *slot = Some(Connection {
                netns,
                socket,
                sequence: 1,
            });
        }
        let connection = slot.as_mut().expect("opened above");
        let result = work(connection);
        if result.is_err() {
            // A socket left with unread answers would hand them to the next request.
            *slot = None;
        }
        result
    })
}

/// A send's worth of requests: the kernel handles a send's messages in order, and its
/// answers must fit the socket's receive buffer until read (each costs about a kilobyte
/// there: 277 of them fill the default 208 KiB, and the kernel drops the rest).
const SEND_BYTES: usize = 32 * 1024;
const SEND_REQUESTS: usize = 64;

/// Sends `requests` in order and checks every acknowledgement; the first refusal, in
/// one line. The kernel goes on with the requests after a refused one (each is its own
/// operation): a caller that needs all or nothing undoes what it asked for.
pub(crate) fn run(requests: &[Request]) -> Result<()> {
    with_connection(|connection| {
        let mut first_error = None;
        let mut start = 0;
        while start < requests.len() {
            let (sent, bytes) = serialize(connection, &requests[start..]);
            connection
                .socket
                .send(&bytes, 0)
                .map_err(|error| runtime(format!("cannot send to the kernel's tc: {error}")))?;
            let chunk = &requests[start..start + sent];
            let answers = receive(connection, chunk.len(), |_| {})?;
            if first_error.is_none() {
                first_error = chunk
                    .iter()
                    .zip(answers)
                    .find_map(|(request, answer)| refusal(request, answer));
            }
            start += sent;
        }
        first_error.map_or(Ok(()), Err)
    })
}

/// Sends one GET; the kernel's answer, or `None` when it has no such object (or shows
/// none: the kernel's built-in `noop` root).
pub(crate) fn get(request: Request) -> Result<Option<TcMessage>> {
    with_connection(|connection| {
        let (_, bytes) = serialize(connection, std::slice::from_ref(&request));
        connection
            .socket
            .send(&bytes, 0)
            .map_err(|error| runtime(format!("cannot send to the kernel's tc: {error}")))?;
        let mut reply = None;
        let answers = receive(connection, 1, |message| reply = Some(message))?;
        match answers.into_iter().next() {
            None | Some(Answer::Done) => Ok(reply),
            Some(Answer::Refused(code, _)) if request.absent.contains(&code) => Ok(None),
            Some(answer) => refusal(&request, answer).map_or(Ok(reply), Err),
        }
    })
}

/// The requests from the first that fit one send, and their bytes.
fn serialize(connection: &mut Connection, requests: &[Request]) -> (usize, Vec<u8>) {
    let mut bytes = Vec::new();
    let mut count = 0;
    for request in requests {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | request.flags;
        header.sequence_number = connection.sequence;
        let mut message = NetlinkMessage::new(
            header,
            NetlinkPayload::InnerMessage(request.message.clone()),
        );
        message.finalize();
        let length = message.buffer_len();
        if count > 0 && (bytes.len() + length > SEND_BYTES || count == SEND_REQUESTS) {
            break;
        }
        connection.sequence = connection.sequence.wrapping_add(1);
        let at = bytes.len();
        bytes.resize(at + length, 0);
        message.serialize(&mut bytes[at..]);
        count += 1;
    }
    (count, bytes)
}

/// What the kernel answered one request.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Answer {
    Done,
    /// errno, and the kernel's words for it if it gave any.
    Refused(i32, Option<String>),
}

/// Reads the acknowledgements of the last `count` requests sent (the kernel answers a
/// send's messages one by one), passing any object a GET returned to `reply`.
fn receive(
    connection: &mut Connection,
    count: usize,
    mut reply: impl FnMut(TcMessage),
) -> Result<Vec<Answer>> {
    let unreadable = |error: &dyn std::fmt::Display| {
        runtime(format!("cannot read the kernel's tc answer: {error}"))
    };
    let first = connection.sequence.wrapping_sub(count as u32);
    let mut answers = vec![None; count];
    let mut buffer = Vec::with_capacity(64 * 1024);
    while answers.iter().any(Option::is_none) {
        buffer.clear();
        connection
            .socket
            .recv(&mut buffer, 0)
            .map_err(|error| unreadable(&error))?;
        let mut offset = 0;
        while offset + 16 <= buffer.len() {
            let message = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buffer[offset..])
                .map_err(|error| unreadable(&error))?;
            offset += (message.header.length as usize).max(16).next_multiple_of(4);
            let index = message.header.sequence_number.wrapping_sub(first) as usize;
            match message.payload {
                NetlinkPayload::Error(error) if index < count => {
                    answers[index] = Some(match error.code {
                        None => Answer::Done,
                        Some(code) => Answer::Refused(
                            -code.get(),
                            kernel_words(&error.header, message.header.flags),
                        ),
                    });
                }
                NetlinkPayload::InnerMessage(
                    RouteNetlinkMessage::NewQueueDiscipline(tc)
                    | RouteNetlinkMessage::NewTrafficClass(tc),
                ) => reply(tc),
                _ => {}
            }
        }
    }
    Ok(answers.into_iter().flatten().collect())
}

/// The one-line error for `request` if the kernel refused it.
fn refusal(request: &Request, answer: Answer) -> Option<anyhow::Error> {
    let Answer::Refused(code, words) = answer else {
        return None;
    };
    if request.absent.contains(&code) {
        return None;
    }
    let reason = std::io::Error::from_raw_os_error(code).to_string();
    let reason = reason.split(" (os error").next().unwrap_or(&reason);
    Some(runtime(match words {
        Some(words) => format!(
            "cannot {}: {reason} (the kernel says: {words})",
            request.what
        ),
        None => format!("cannot {}: {reason}", request.what),
    }))
}

/// The kernel's message in an error's payload (NLMSGERR_ATTR_MSG), if it gave one: after
/// the echoed request (only its header when capped).
fn kernel_words(payload: &[u8], flags: u16) -> Option<String> {
    const NLMSGERR_ATTR_MSG: u16 = 1;
    let echoed = if flags & NLM_F_CAPPED != 0 {
        16
    } else {
        u32::from_ne_bytes(payload.get(0..4)?.try_into().ok()?) as usize
    };
    let mut offset = echoed.next_multiple_of(4);
    while offset + 4 <= payload.len() {
        let length = usize::from(u16::from_ne_bytes(
            payload[offset..offset + 2].try_into().ok()?,
        ));
        let kind = u16::from_ne_bytes(payload[offset + 2..offset + 4].try_into().ok()?);
        if length < 4 || offset + length > payload.len() {
            return None;
        }
        if kind == NLMSGERR_ATTR_MSG {
            let text = &payload[offset + 4..offset + length];
            let text = text.split(|&byte| byte == 0).next().unwrap_or(text);
            return Some(String::from_utf8_lossy(text).trim().to_string());
        }
        offset += length.next_multiple_of(4);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_words_are_read_after_the_echoed_header() {
        // A capped error: the request's 16-byte header, then NLMSGERR_ATTR_MSG.
        let mut payload = vec![0u8; 16];
        let text = b"Specified class not found\0";
        let length = 4 + text.len() as u16;
        payload.extend_from_slice(&length.to_ne_bytes());
        payload.extend_from_slice(&1u16.to_ne_bytes());
        payload.extend_from_slice(text);
        assert_eq!(
            kernel_words(&payload, NLM_F_CAPPED).as_deref(),
            Some("Specified class not found")
        );
        // Uncapped: the whole request (its length first) comes before the attributes.
        let mut uncapped = 20u32.to_ne_bytes().to_vec();
        uncapped.extend_from_slice(&[0u8; 16]);
        uncapped.extend_from_slice(&payload[16..]);
        assert_eq!(
            kernel_words(&uncapped, 0).as_deref(),
            Some("Specified class not found")
        );
        assert_eq!(kernel_words(&payload[..16], NLM_F_CAPPED), None);
    }

    #[test]
    fn a_refusal_names_the_request_and_a_delete_of_what_is_gone_is_done() {
        let add = Request::htb_class(
            "dm0",
            3,
            (0x5348_0000, 0x5348_01f5),
            &HtbClassOptions {
                rate_bits_per_sec: 8,
                ceil_bits_per_sec: 8,
                burst_bytes: 1,
                cburst_bytes: 1,
                quantum: 1514,
                prio: 0,
            },
            true,
        );
        let refused = Answer::Refused(nix::libc::EEXIST, None);
        assert_eq!(
            refusal(&add, refused).unwrap().to_string(),
            "cannot add HTB class 5348:1f5 on dm0: File exists"
        );
        let said = Answer::Refused(nix::libc::EINVAL, Some("Specified class not found".into()));
        assert_eq!(
            refusal(&add, said).unwrap().to_string(),
            "cannot add HTB class 5348:1f5 on dm0: Invalid argument (the kernel says: \
             Specified class not found)"
        );
        let delete = Request::delete_class("dm0", 3, 0x5348_0001);
        for gone in [nix::libc::ENOENT, nix::libc::ENODEV] {
            assert!(refusal(&delete, Answer::Refused(gone, None)).is_none());
        }
        assert!(refusal(&delete, Answer::Refused(nix::libc::EBUSY, None)).is_some());
        assert!(refusal(&add, Answer::Done).is_none());
    }
}
