//! `class add` and `class change` options, made from the one declaration of a class's
//! fields (`shaper::class_input::FIELDS`): a new field shows up in both by itself.

use clap::{Arg, ArgMatches, Args, Command, FromArgMatches};
use shaper::class_input::{ClassInput, FieldInfo, FIELDS};

/// Fields the commands take their own way: the name is positional, the direction picks
/// the attachment.
const OWN_WAY: [&str; 2] = ["name", "direction"];

/// The class fields of `class add` (`CHANGE = false`: every field) or of `class change`
/// (the fields a live class can change), as written.
#[derive(Clone, Debug, Default)]
pub struct ClassFields<const CHANGE: bool>(pub ClassInput);

impl<const CHANGE: bool> ClassFields<CHANGE> {
    fn taken() -> impl Iterator<Item = &'static FieldInfo> {
        FIELDS
            .iter()
            .filter(|field| !OWN_WAY.contains(&field.name) && (!CHANGE || field.in_place))
    }

    /// The options, as `--help` spells them.
    pub fn flags() -> Vec<String> {
        Self::taken().map(|field| flag(field.name)).collect()
    }
}

/// A field's option: `peak_rate` is `--peak-rate`.
fn flag(name: &str) -> String {
    format!("--{}", name.replace('_', "-"))
}

impl<const CHANGE: bool> Args for ClassFields<CHANGE> {
    fn augment_args(command: Command) -> Command {
        Self::taken().fold(command, |command, field| {
            let mut arg = Arg::new(field.name)
                .long(field.name.replace('_', "-"))
                .value_name(field.value_name)
                .help(field.help_line());
            if !CHANGE {
                arg = arg.required(field.required);
                if let Some(default) = field.default {
                    arg = arg.default_value(default);
                }
            }
            command.arg(arg)
        })
    }

    fn augment_args_for_update(command: Command) -> Command {
        Self::augment_args(command)
    }
}

impl<const CHANGE: bool> FromArgMatches for ClassFields<CHANGE> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut input = ClassInput::default();
        for field in Self::taken() {
            let slot = input.get_mut(field.name).expect("a declared field");
            *slot = matches.get_one::<String>(field.name).cloned();
        }
        Ok(Self(input))
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}
